"""When a worker dispatches a batch, and how prompts are grouped: the Ascend ATB/MindIE
``DynamicBatchingConfig`` knob set, validated on construction."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from tokenfleet.config.settings import setting

MODES = ("static", "dynamic", "continuous")
PADDINGS = ("bucket", "max")  # the old spelling of mix_buckets (no / yes); kept for one release
DEFAULT_BUCKETS = (128, 512, 2048)  # x4 up to the default max_seq_len (see config.model_fit)


@dataclass(frozen=True)
class DynamicBatchingConfig:
    """When a worker dispatches a batch, and which prompts go together.

    - ``static``: dispatch only when ``max_batch_size`` requests are pending.
    - ``dynamic``: dispatch when ``max_batch_size`` are pending or the oldest pending request has
      waited ``max_wait_ms``, whichever comes first; the batch runs to completion.
    - ``continuous``: like ``dynamic`` for the first batch; afterwards waiting requests join the
      running batch at the next step while slots and KV blocks allow.

    ``mix_buckets`` forms a batch from every bucket's waiting requests, oldest first; without it a
    batch holds one bucket's. Prefill packs prompts end to end either way, so mixing pads nothing.
    (``padding`` is its old spelling: ``bucket`` = no, ``max`` = yes.)

    ``max_prefill_tokens`` (continuous; MindIE's ``maxPrefillTokens``) bounds one prefill step: a
    larger batch starts in parts, a decode step between them. ``max_new_tokens_cap`` (MindIE's
    ``maxIterTimes``) bounds what a request may ask.
    """

    max_wait_ms: float = setting(50.0, "Longest time the oldest waiting request waits for a batch to fill.")
    max_batch_size: int = setting(32, "Most sequences per batch.")
    max_seq_len: int = setting(
        2048,
        "Longest prompt + generated tokens a request may need.",
        default_text="the model's context length (2048 where its config does not say)",
    )
    buckets: tuple[int, ...] = setting(
        DEFAULT_BUCKETS,
        "Prompt-length buckets served, comma-separated.",
        kind="buckets",
        default_text="128,512,2048,... (x4) up to max_seq_len",
    )
    mix_buckets: bool = setting(
        False,
        "Form each batch from every bucket's waiting requests, oldest first, instead of one bucket's "
        "(fuller batches; prefill packs prompts end to end, so mixing pads nothing).",
    )
    padding: str | None = setting(
        None,
        "Deprecated: the old spelling of --mix-buckets (bucket: --no-mix-buckets, max: --mix-buckets).",
        kind="str",
        choices=PADDINGS,
    )
    mode: str = setting(
        "continuous",
        "static: wait for a full batch; dynamic: full batch or max-wait-ms, run to completion; "
        "continuous: dynamic, then join waiting requests at every step.",
        choices=MODES,
    )
    max_prefill_tokens: int = setting(
        1024,
        "continuous: prompt tokens one prefill step may take; a larger batch starts in parts with a "
        "decode step between them (earlier first tokens; a longer prompt still starts, alone).",
    )
    max_new_tokens_cap: int = setting(4096, "Largest max_new_tokens a request may ask for.")
    promote_after_s: float = setting(
        30.0,
        "A batch-lane request waiting in a worker this long goes as if it were interactive: the "
        "interactive lane always goes first, but never starves the batch lane.",
    )

    ttft_target_ms: float | None = setting(
        None,
        "Choose the wait for a batch at run time (one decode step to max-wait-ms) to keep the interactive "
        "lane's p90 time to first token under this: the largest batches the target allows.",
        kind="float",
    )
    batch_ttft_target_ms: float | None = setting(
        None, "The same for the batch lane (without it, the batch lane waits max-wait-ms).", kind="float"
    )

    def __post_init__(self) -> None:
        if not (isinstance(self.max_wait_ms, (int, float)) and self.max_wait_ms >= 0):
            raise ValueError(f"max_wait_ms must be a number >= 0, got {self.max_wait_ms!r}")
        for name in ("max_batch_size", "max_prefill_tokens", "max_new_tokens_cap"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not (isinstance(self.max_seq_len, int) and self.max_seq_len >= 2):
            raise ValueError(f"max_seq_len must be an integer >= 2, got {self.max_seq_len!r}")
        buckets = tuple(self.buckets)
        if not buckets:
            raise ValueError("buckets must not be empty")
        if any(not isinstance(b, int) or b < 1 for b in buckets):
            raise ValueError(f"buckets must be positive integers, got {buckets!r}")
        if list(buckets) != sorted(set(buckets)):
            raise ValueError(f"buckets must be strictly increasing, got {buckets!r}")
        if buckets[-1] > self.max_seq_len:
            raise ValueError(
                f"buckets: the largest bucket ({buckets[-1]}) is longer than max_seq_len ({self.max_seq_len})"
            )
        if not (isinstance(self.promote_after_s, (int, float)) and self.promote_after_s >= 0):
            raise ValueError(f"promote_after_s must be a number >= 0, got {self.promote_after_s!r}")
        for name in ("ttft_target_ms", "batch_ttft_target_ms"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if not isinstance(self.mix_buckets, bool):
            raise ValueError(f"mix_buckets must be true or false, got {self.mix_buckets!r}")
        if self.padding is not None:
            self._take_old_padding_spelling()
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        object.__setattr__(self, "buckets", buckets)

    def _take_old_padding_spelling(self) -> None:
        if self.padding not in PADDINGS:
            raise ValueError(f"padding must be one of {PADDINGS}, got {self.padding!r}")
        mix = self.padding == "max"
        if self.mix_buckets and not mix:
            raise ValueError("padding 'bucket' contradicts mix_buckets: give mix_buckets alone")
        warnings.warn(
            f"padding={self.padding!r} is deprecated: use {'--mix-buckets' if mix else '--no-mix-buckets'} "
            "(config key mix_buckets); the old spelling goes in the next release",
            FutureWarning,
            stacklevel=4,
        )
        object.__setattr__(self, "mix_buckets", mix)
        object.__setattr__(self, "padding", None)

    @property
    def max_wait_s(self) -> float:
        return self.max_wait_ms / 1000.0

    @property
    def largest_bucket(self) -> int:
        return self.buckets[-1]
