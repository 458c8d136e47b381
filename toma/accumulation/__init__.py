"""Gradient accumulation: `toma.accumulate`, with the gradient and buffer rollback of a failed attempt and the
checks that catch an accumulated function stepping the optimizer itself."""
