"""benchmarks/import_time.py run once as a test: its figures parse, and `import toma` leaves FSDP2 unimported."""

import import_time


def test_import_time_measures_torch_and_tomas_share_in_fresh_interpreters(capsys):
    figures = import_time.measure(rounds=1)
    import_time.report(figures)
    assert figures["torch alone"][0] > 0 and figures["toma's share"][0] > 0
    assert figures["modules toma adds"][0] > 10  # toma's own modules, counted in the interpreter that imported them
    assert figures["fsdp2 imported"] == [0.0]
    assert "toma's share" in capsys.readouterr().out
