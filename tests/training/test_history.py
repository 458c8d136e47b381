"""TrainingHistory: save/load round trips and the plot; EpochTally: an epoch's steps added up."""

import sys

import pytest
import torch

from toma.training.history import PLOT_HINT, EpochTally, TrainingHistory


def sample():
    return TrainingHistory(
        epochs=[
            dict(epoch=1, step=2, loss=0.5, micro_batch=64, oom_retries=1, peak_rss=123456, peak_cuda_allocated=None),
            dict(epoch=2, step=4, loss=0.25, micro_batch=64, oom_retries=0, peak_rss=123457, eval_loss=0.3),
        ],
        steps=[
            dict(step=s, epoch=1 + (s > 2), loss=1.0 / s, micro_batch=64, rows=256, oom_retries=int(s == 1))
            for s in range(1, 5)
        ],
    )


def test_json_round_trip(tmp_path):
    history = sample()
    history.save(str(tmp_path / "history.json"))
    assert TrainingHistory.load(str(tmp_path / "history.json")) == history


def test_csv_round_trip_keeps_the_epochs(tmp_path):
    history = sample()
    history.save(str(tmp_path / "history.csv"))
    loaded = TrainingHistory.load(str(tmp_path / "history.csv"))
    expected = [{**e, **{k: None for k in ("peak_cuda_allocated", "eval_loss") if k not in e}} for e in history.epochs]
    assert loaded.epochs == expected and loaded.steps == []
    assert loaded.column("eval_loss") == [None, 0.3]


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    sample().plot(str(tmp_path / "history.png"))
    assert (tmp_path / "history.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_get_it(tmp_path, monkeypatch):
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    with pytest.raises(ImportError, match="pip install matplotlib") as info:
        sample().plot(str(tmp_path / "history.png"))
    assert str(info.value) == PLOT_HINT


def trained_history():
    """Three epochs of 96 rows in logical batches of 40 (40, 40, 16), evaluated with a loss and an accuracy."""
    steps, epochs, step = [], [], 0
    for epoch in (1, 2, 3):
        for rows in (40, 40, 16):
            step += 1
            steps.append(dict(step=step, epoch=epoch, loss=1.0 / step, micro_batch=20, rows=rows, oom_retries=0))
        epochs.append(dict(epoch=epoch, step=step, loss=0.5, eval_loss=0.6 / epoch, eval_accuracy=0.3 * epoch))
    return TrainingHistory(epochs, steps)


def test_the_plot_shows_evaluation_metrics_epoch_ends_and_a_steady_logical_batch(tmp_path):
    pytest.importorskip("matplotlib")
    figure = trained_history().plot(str(tmp_path / "history.png"))
    lines = {line.get_label(): line for axes in figure.axes for line in axes.get_lines()}
    assert list(lines["eval_accuracy (epoch)"].get_ydata()) == pytest.approx([0.3, 0.6, 0.9])
    assert list(lines["evaluation loss (epoch)"].get_xdata()) == [3, 6, 9]
    assert set(lines["logical batch"].get_ydata()) == {40}, "no saw-tooth at each epoch's short last batch"
    assert list(lines["short last batch"].get_xdata()) == [3, 6, 9]
    boundaries = [line for axes in figure.axes for line in axes.get_lines() if line.get_gid() == "epoch end"]
    assert len(boundaries) == 2 * len(figure.axes) and len(figure.axes) == 3
    assert (tmp_path / "history.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_epoch_tally_means_over_what_the_steps_averaged_over_and_keeps_full_batches_micro_batch():
    tally = EpochTally(mean=True)
    tally.add(torch.tensor(1.0), 3.0, 4, micro_batch=2, full=True)
    tally.add(torch.tensor(2.0), 1.0, 1, micro_batch=1, full=False)
    assert tally.loss() == pytest.approx((1.0 * 3 + 2.0 * 1) / 4)
    assert tally.sizes == [4, 1] and tally.micro_batch == 2


def test_epoch_tally_of_summed_losses_is_their_sum_per_row_and_of_nothing_counted_zero():
    """Per row, as `evaluate` gives a summed loss: the training and evaluation losses on one scale."""
    summed = EpochTally(mean=False)
    summed.add(torch.tensor(4.0), 2.0, 2, micro_batch=None, full=False)
    summed.add(torch.tensor(6.0), 2.0, 3, micro_batch=2, full=True)
    assert summed.loss() == pytest.approx(10.0 / 5) and summed.micro_batch == 2
    empty = EpochTally(mean=True)
    empty.add(torch.tensor(float("nan")), 0.0, 3, micro_batch=3, full=True)
    assert empty.loss() == 0.0
