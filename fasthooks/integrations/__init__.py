"""One callback per training framework, each `ActivationStatsCallback(**activation_stats_args)`:

- `fasthooks.integrations.lightning`: a `lightning.pytorch.Callback`;
- `fasthooks.integrations.transformers`: a `transformers.TrainerCallback`;
- `fasthooks.integrations.fastai`: a fastai (v2) `Callback`.

Each module imports its framework; importing fasthooks imports none of them.
"""
