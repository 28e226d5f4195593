"""Small utilities shared across tfaploss, models and pipelines."""
