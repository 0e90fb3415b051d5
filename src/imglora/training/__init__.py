"""Training: the trainer (the loop), one optimizer update (step), checkpoints and resume, the run lock,
optimizers, EMA, out-of-memory reports and clean stops."""
