"""Models without a model hub: random-weight test models built locally (:mod:`.random_init`) and
real ones fetched from the package registry (:mod:`.catalog`)."""

from tokenfleet.models.random_init import PAD_ID, SIZES, VOCAB_SIZE, init_model, is_model_dir

__all__ = ["PAD_ID", "SIZES", "VOCAB_SIZE", "init_model", "is_model_dir"]
