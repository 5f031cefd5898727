"""Two callbacks per training framework, `ActivationStatsCallback(**activation_stats_args)` and
`ParameterStatsCallback(**parameter_stats_args)`:

- `fasthooks.integrations.lightning`: `lightning.pytorch.Callback`s;
- `fasthooks.integrations.transformers`: `transformers.TrainerCallback`s;
- `fasthooks.integrations.fastai`: fastai (v2) `Callback`s.

Each module imports its framework; importing fasthooks imports none of them.
"""
