"""`toma.Trainer`: whole trainings on `toma.accumulate`, with their history and progress display."""
