"""Progress output: the epoch line and the verbosity levels."""

import io

from toma.training.progress import Progress, format_epoch

RECORD = dict(
    loss=0.1234567, eval_loss=0.2, eval_accuracy=0.95, samples_per_s=1234.5, micro_batch=64, oom_retries=2, time=3.21
)


def test_the_epoch_line_says_everything():
    assert format_epoch(2, 10, RECORD) == (
        "epoch 3/10: loss 0.1235 - eval_loss 0.2 - eval_accuracy 0.95 - 1234 samples/s - micro-batch 64 "
        "- 2 OOM retries - 3.2 s"
    )


def test_verbosity_levels():
    outputs = {}
    for verbose in (0, 1, 2):
        out = io.StringIO()
        progress = Progress(verbose, out)
        progress.start_epoch(0, 1, 2)
        progress.step(dict(loss=lambda: "0.5", micro_batch=64))
        progress.step(dict(loss=lambda: "0.4", micro_batch=64))
        progress.end_epoch(0, 1, RECORD)
        progress.close()
        outputs[verbose] = out.getvalue()
    assert outputs[0] == ""
    assert outputs[1] == format_epoch(0, 1, RECORD) + "\n"
    assert "epoch 1/1" in outputs[2] and "2/2" in outputs[2] and "micro-batch 64" in outputs[2]
