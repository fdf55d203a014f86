"""vLLM's V1 ``LLMEngine`` behind the engine core's interface, in the worker's own process.

tokenfleet keeps admission and the text: our batcher decides when requests are handed to vLLM
(``max_wait_ms``, static / dynamic / continuous, at most ``max_batch_size`` at once, which is also
vLLM's ``max_num_seqs``); vLLM returns token ids only (no tokenizer, no detokenizing, no stop
strings there), and :class:`~tokenfleet.core.sequence.SeqState` turns them into text deltas, stop
strings and finish reasons exactly as with the native engine. A sequence that ends on our side
(EOS, a stop string) is aborted in vLLM; a token vLLM returns for a sequence no longer ours is
dropped, so nothing follows a terminal event.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Collection, Hashable
from typing import Any

from tokenfleet.batcher import Batch
from tokenfleet.config import DynamicBatchingConfig, WorkerConfig
from tokenfleet.core.admission import Limits
from tokenfleet.core.front import CoreFront
from tokenfleet.core.interface import BatchEvent, Capacity, ModelFacts, StepOutput, TokenOutput
from tokenfleet.core.sequence import SeqState
from tokenfleet.core.vocab import eos_token_ids
from tokenfleet.engines.vllm.adapters import (
    LoraRequests,
    adapter_refusal,
    decoder_linears,
    keep_base_rows_base,
)
from tokenfleet.engines.vllm.args import engine_args
from tokenfleet.engines.vllm.controls import control_kwargs, vllm_logprobs
from tokenfleet.protocol import Refusal, Request
from tokenfleet.protocol.adapters import AdapterRecord
from tokenfleet.protocol.request import max_token_chars

log = logging.getLogger(__name__)

CANNOT_RESUME = "a response_format request cannot resume after a crash on the vllm backend"


class VllmCore(CoreFront):
    """The ``vllm`` :class:`~tokenfleet.core.interface.EngineCore`."""

    backend = "vllm"

    def __init__(
        self,
        engine: Any,
        batching: DynamicBatchingConfig,
        facts: ModelFacts,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.engine = engine
        cache = engine.vllm_config.cache_config
        self.block_size = int(cache.block_size)
        self.num_blocks = max(0, int(cache.num_gpu_blocks or 0) - 1)  # less vLLM's null block
        self.max_model_len = int(engine.model_config.max_model_len)
        limits = Limits(
            buckets=batching.buckets,
            max_seq_len=min(batching.max_seq_len, self.max_model_len),
            max_new_tokens_cap=batching.max_new_tokens_cap,
            vocab_size=facts.vocab_size,
            max_token_chars=facts.max_token_chars,
            kv_tokens_per_seq=min(self.num_blocks * self.block_size, self.max_model_len),
        )
        super().__init__(facts, limits, batching, clock)
        self.prefix_cache_queries = 0  # prompt tokens handed to vLLM ...
        self.prefix_cache_hits = 0  # ... of which its prefix cache held the K/V (its num_cached_tokens)
        self._first_output: set[str] = set()  # handed over, no output yet: its cache hits not counted
        self._active: dict[str, SeqState] = {}  # handed to vLLM, by vLLM request id, in order
        lora = engine.vllm_config.lora_config
        self.max_lora_rank = int(lora.max_lora_rank) if lora is not None else 0  # 0: adapters off
        self._loras = LoraRequests()
        self._linears = decoder_linears(engine.model_config.hf_config)
        if lora is not None:
            keep_base_rows_base()

    def output_constraint(self, request: Request) -> Any:
        """The output controls go to vLLM (:mod:`.controls`), grammars included: compiled here
        first only to refuse one that cannot compile (``invalid_grammar``) before vLLM sees it."""
        checked = super().output_constraint(request)
        return checked if isinstance(checked, Refusal) else None

    def add(self, seq: SeqState, arrived: float) -> Refusal | None:
        """Queue ``seq``; the adapter it names is checked first."""
        return adapter_refusal(seq, self.max_lora_rank, self._linears) or super().add(seq, arrived)

    def preload(self, adapters: list[AdapterRecord]) -> None:
        pass  # vLLM loads an adapter with the first request that names it

    def open_parked(self) -> list[tuple[SeqState, Refusal]]:
        return []  # nothing is parked: vLLM queues a request while it loads its adapter

    @classmethod
    def from_config(cls, config: WorkerConfig) -> VllmCore:
        """Start vLLM for ``config`` (in this process: a worker killed with it leaves no engine
        process behind) and read the model's vocabulary facts beside it."""
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLMEngine

        args = engine_args(config)
        model = config.engine.model or ""
        log.info("starting vLLM's engine for %s (%s)", model, args.dtype)
        engine = LLMEngine.from_engine_args(args)
        core = cls(engine, config.batching, model_facts(model, engine))
        log.info(
            "vLLM ready: KV cache %d blocks x %d tokens, max_model_len %d",
            core.num_blocks,
            core.block_size,
            core.max_model_len,
        )
        return core

    # -- what it holds --------------------------------------------------------------------------

    def held(self) -> list[SeqState]:
        return [*self._active.values(), *self.waiting()]

    def running(self) -> list[SeqState]:
        return list(self._active.values())

    @property
    def num_waiting(self) -> int:
        return len(self.batcher)

    def waiting_in(self, lane: int) -> int:
        return self.batcher.waiting_in(lane)

    @property
    def has_work(self) -> bool:
        return bool(self._active) or self.batcher.is_due()

    def capacity(self) -> Capacity:
        return Capacity(
            max_seq_len=self.admission.limits.max_seq_len,
            block_size=self.block_size,
            kv_blocks_total=self.num_blocks,
            kv_blocks_used=self.num_blocks - self._free_blocks(),
            running=len(self._active),
            waiting=self.num_waiting,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
        )

    def _free_blocks(self) -> int:
        """vLLM's free KV blocks (cached prefixes count as free: they are evicted on demand)."""
        scheduler = _scheduler(self.engine)
        if scheduler is None:
            return self.num_blocks
        return int(scheduler.kv_cache_manager.block_pool.get_num_free_blocks())

    def check_idle(self) -> None:
        if not self._active and self.engine.has_unfinished_requests():
            raise RuntimeError("vLLM holds unfinished requests that tokenfleet no longer runs")

    def close(self) -> None:
        self.abort(list(self._active))

    # -- stepping -------------------------------------------------------------------------------

    def step(self, flush: bool = False) -> StepOutput:
        handed, failed = self._hand_over(flush)
        batches: list[BatchEvent] = []
        if handed:
            prompt_tokens = sum(len(s.all_tokens) for s in handed)
            batches.append(BatchEvent("prefill", len(handed), prompt_tokens, prompt_tokens=prompt_tokens))
        if not self._active:
            return StepOutput(failed=failed, batches=batches)
        size = len(self._active)
        tokens: list[TokenOutput] = []
        for result in self.engine.step():
            seq = self._active.get(result.request_id)
            if seq is None:  # aborted on our side: nothing of it is streamed any more
                continue
            if result.request_id in self._first_output:
                self._first_output.discard(result.request_id)
                seq.cached_tokens = int(getattr(result, "num_cached_tokens", 0) or 0)
                self.prefix_cache_hits += seq.cached_tokens
            output, top = result.outputs[0], seq.request.logprobs
            for i, token_id in enumerate(output.token_ids):
                logprob = None if top is None else vllm_logprobs(output.logprobs[i], token_id, top)
                tokens.append(TokenOutput.append(seq, token_id, logprob))
                if seq.finished:
                    break
            if seq.finished or result.finished:
                del self._active[result.request_id]
            if seq.finished and not result.finished:
                self.engine.abort_request([result.request_id])  # EOS or a stop string, ours
            elif result.finished and not seq.finished:  # vLLM ended it early: not our rule
                failed.append((seq, f"vLLM ended the request ({result.outputs[0].finish_reason})"))
        for seq in self._active.values():
            seq.decode_steps += 1
            seq.batch_size_sum += size
        if not handed:
            batches.append(BatchEvent("decode", size))
        return StepOutput(tokens, [], failed, batches)

    def _hand_over(self, flush: bool) -> tuple[list[SeqState], list[tuple[SeqState, str]]]:
        """Requests the batching rule starts now, added to vLLM: with nothing running, the batch
        that is due (all waiting ones when ``flush``); in continuous mode also joiners while
        fewer than ``max_batch_size`` run. Also those that cannot start, with why."""
        room = self.config.max_batch_size - len(self._active)
        batch: Batch | None = None
        if room > 0 and not self._active:
            batch = self.batcher.take(room) if flush else self.batcher.next_batch(room)
        elif room > 0 and self.config.mode == "continuous":
            batch = self.batcher.take(room)
        if batch is None:
            return [], []
        seqs = [item.payload for item in batch.items]
        # vLLM's grammars start from the first token: one cannot go on from a crashed attempt's
        cannot = [(s, CANNOT_RESUME) for s in seqs if s.generated and s.request.response_format is not None]
        seqs = [s for s in seqs if not (s.generated and s.request.response_format is not None)]
        now = time.time()
        for seq in seqs:
            request_id = vllm_request_id(seq.key)
            self.engine.add_request(
                request_id,
                _prompt(seq),
                sampling_params(seq),
                lora_request=self._loras.of(seq),
            )
            self._active[request_id] = seq
            self._first_output.add(request_id)
            self.prefix_cache_queries += len(seq.all_tokens)
            if seq.started is None:
                seq.started = now
        for seq in seqs:
            seq.batch_size = seq.batch_size or len(self._active)
        return seqs, cannot

    def abort(self, keys: Collection[Hashable]) -> list[SeqState]:
        ids = [rid for rid, seq in self._active.items() if seq.key in keys]
        gone = [self._active.pop(rid) for rid in ids]
        self._first_output.difference_update(ids)
        if ids:
            self.engine.abort_request(ids)
        return gone + self.remove_waiting(keys)


def model_facts(model_dir: str, engine: Any) -> ModelFacts:
    """The vocabulary facts of the model vLLM serves, read from its directory (vLLM runs without
    a tokenizer: tokenfleet tokenizes and detokenizes)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    try:
        generation = GenerationConfig.from_pretrained(model_dir)
    except OSError:  # no generation_config.json: the model config's EOS holds
        generation = None
    model_config = engine.model_config
    return ModelFacts(
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids(generation, AutoConfig.from_pretrained(model_dir), tokenizer),
        vocab_size=int(model_config.get_vocab_size()),
        max_token_chars=max_token_chars(tokenizer),
        device=str(engine.vllm_config.device_config.device_type),
        dtype=str(model_config.dtype).removeprefix("torch."),
    )


def vllm_request_id(key: Hashable) -> str:
    """vLLM wants string ids; a sequence's key (stream and entry id in the worker) is unique."""
    return key if isinstance(key, str) else repr(key)


def sampling_params(seq: SeqState) -> Any:
    """vLLM's parameters for the rest of ``seq``: token ids only, as deltas; ends are ours (EOS is
    ignored there and the sequence aborted when we end it), so only the length limit is vLLM's."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    req = seq.request
    return SamplingParams(
        max_tokens=req.max_new_tokens - len(seq.generated),
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        seed=req.seed,
        ignore_eos=True,
        detokenize=False,
        **control_kwargs(seq),
        output_kind=RequestOutputKind.DELTA,
    )


def _scheduler(engine: Any) -> Any:
    """vLLM's scheduler when its engine core runs in this process (for KV usage), else None."""
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
    return getattr(core, "scheduler", None)


def _prompt(seq: SeqState) -> dict[str, Any]:
    """vLLM's prompt; a tenant's ``cache_salt`` keeps its blocks apart in vLLM's prefix cache."""
    salt = {} if seq.request.tenant is None else {"cache_salt": "tenant:" + seq.request.tenant}
    return {"prompt_token_ids": seq.all_tokens, **salt}
