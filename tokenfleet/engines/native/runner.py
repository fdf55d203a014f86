"""The native model runner: a Hugging Face causal LM whose attention reads and writes a paged KV cache.

The runner owns the model and the K/V store; the scheduler owns the block allocator and hands the
runner each sequence's block table. It knows nothing of Redis or of requests: callers give it
block tables and token lists, and get next-token logits back.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from tokenfleet.config import DynamicBatchingConfig, EngineConfig, KVCacheConfig
from tokenfleet.core.interface import ModelFacts
from tokenfleet.core.sequence import SeqState
from tokenfleet.core.vocab import eos_token_ids
from tokenfleet.engines.native.attention import paged as attention
from tokenfleet.engines.native.attention import triton_paged
from tokenfleet.engines.native.attention.paged import CURRENT_STEP
from tokenfleet.engines.native.attention.step_inputs import Uploader, decode_step, padded_tables, prefill_step
from tokenfleet.engines.native.compiled import compile_steps, warm_up
from tokenfleet.engines.native.cuda_graphs import DecodeGraphs
from tokenfleet.engines.native.decoder import lean_decoder
from tokenfleet.engines.native.device import select_device, select_dtype
from tokenfleet.engines.native.kernels.loader import load_kernels
from tokenfleet.engines.native.linear.routes import linear_route, pack_for_route
from tokenfleet.engines.native.loading import ModelShape, finish_logits, kv_pool, load_model
from tokenfleet.engines.native.lora.linear import adaptable_linears
from tokenfleet.engines.native.lora.pool import attach_lora
from tokenfleet.engines.native.probe import check_runner, probe_tokens, take_reference
from tokenfleet.engines.native.sampling.grammar_masks import GrammarMasks, PendingMasks
from tokenfleet.engines.native.sampling.logits_process import choose_controlled
from tokenfleet.engines.native.shapes import decode_buckets, prefill_forwards, prefill_padded_size
from tokenfleet.engines.native.types import Chosen, PrefillHead, PrefillResult
from tokenfleet.protocol.request import max_token_chars

log = logging.getLogger(__name__)

# Prefill packs whole prompts into forwards of at most this many tokens (activation memory bound).
PREFILL_CHUNK_TOKENS = 8192


class ModelRunner:
    """Loads a model with the paged attention function and runs prefill and decode steps."""

    def __init__(self, engine: EngineConfig, kv: KVCacheConfig, batching: DynamicBatchingConfig):
        """The model ``engine.model`` on ``engine.device`` in ``engine.dtype``, its linears on the
        CPU routes ``engine`` names; a pool of KV blocks sized by ``kv``; decode padded to batches
        up to ``batching.max_batch_size`` (compiled, CUDA graphs), tables ``max_seq_len`` wide."""
        if engine.model is None:
            raise ValueError("model: the runner needs a model directory")
        self.kv = kv
        self.device = select_device(engine.device)
        self.dtype = select_dtype(engine.dtype, self.device)
        self.tokenizer, self.model = load_model(engine.model, self.device, self.dtype)
        shape = ModelShape.of(self.model)
        self.hidden_size = int(self.model.config.get_text_config().hidden_size)
        self.finish_logits = finish_logits(self.model.config)  # the head's own softcap or scale
        self.vocab_size = shape.vocab_size
        self.grammar_masks = GrammarMasks(self.vocab_size)
        self.block_size = kv.block_size
        pool = kv_pool(self.model, shape, kv, batching.max_seq_len)  # counts the weights as loaded
        # transformers' own forward over a probe, before our routes change the model: checked below
        reference = take_reference(self.model, probe_tokens(self.vocab_size, pool.num_blocks * kv.block_size))
        # a sliding window or softcap the kernels and the lean forward do not compute: the torch route
        variants = reference.attention_variants(batching.max_seq_len)
        if variants:
            log.info("engine: attention in torch, not the C++ kernels (the model asks for %s)", variants)
        self.store = pool.store
        self.num_blocks = pool.num_blocks  # what the scheduler's allocator may hand out
        self.bytes_per_block = pool.bytes_per_block
        self.scratch_block = pool.scratch_block  # where padding tokens' K/V go
        # attention in C++ on CPU (decode straight from the pool, prefill on the packed prompts);
        # elsewhere (and without a compiler) SDPA runs on gathered blocks and padded prompts
        on_cpu = self.device.type == "cpu"
        self.use_kernel = on_cpu and not variants and load_kernels(engine.paged_kernel) is not None
        self.use_prefill_kernel = self.use_kernel and shape.head_dim % 16 == 0  # its widest vector (AVX-512)
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.upload = Uploader(self.device)  # a step's integer inputs: one copy to the device
        self.pad_prefill = self.device.type == "cpu"  # see shapes.prefill_padded_size
        self.decode_buckets = decode_buckets(batching.max_batch_size)
        # on a GPU: decode attention in the Triton kernel (block tables read on the device)
        self.use_triton = self.device.type == "cuda" and not variants and triton_paged.available()
        graphed = engine.cuda_graphs and self.use_triton
        self.graphs = self._decode_graphs(batching.max_seq_len) if graphed else None
        # LoRA in eager CPU steps, on the C++ kernel (linears read before the lean forward fuses them)
        slots = engine.lora_slots("native")
        adapters = slots > 0 and not engine.compile and on_cpu and load_kernels() is not None
        linears = adaptable_linears(self.model) if adapters else {}
        # eager CPU steps run the lean forward where the architecture allows (compiled ones fuse themselves)
        self.lean = lean_decoder(self.model) if self.use_kernel and not engine.compile else None
        route = linear_route(
            self.device, self.dtype, self.model, engine.bf16_linear, engine.onednn_linear, engine.f32_linear
        )
        pack_for_route(self.model, route, self.dtype)
        self.lora = (
            attach_lora(self.model, linears, slots, engine.max_lora_rank, self.dtype) if adapters else None
        )
        buckets = len(self.decode_buckets)
        self.compiled_decode, self.compiled_prefill = compile_steps(
            self.model, self.device, buckets, engine.compile
        )
        self.pad_decode_batches = engine.compile  # to decode_buckets; eager steps can pad too (tests do)
        self.eos_token_ids = eos_token_ids(
            getattr(self.model, "generation_config", None), self.model.config, self.tokenizer
        )
        self.max_token_chars = max_token_chars(self.tokenizer)
        check_runner(self, reference)  # a model computed wrong is refused here (ModelMismatch)
        log.info(
            "engine: %s on %s/%s, KV pool %d blocks x %d tokens (%.1f MiB)",
            engine.model,
            self.device,
            str(self.dtype).removeprefix("torch."),
            self.num_blocks,
            kv.block_size,
            self.store.nbytes / 2**20,
        )

    def _decode_graphs(self, max_seq_len: int) -> DecodeGraphs:
        table_width = -(-max_seq_len // self.block_size)
        return DecodeGraphs(
            self.store, self.upload, self.decode_buckets, table_width, self.scratch_block, self.pad_token_id
        )

    def facts(self) -> ModelFacts:
        return ModelFacts(
            tokenizer=self.tokenizer,
            eos_token_ids=self.eos_token_ids,
            vocab_size=self.vocab_size,
            max_token_chars=self.max_token_chars,
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
        )

    def start_masks(self, seqs: list[SeqState]) -> PendingMasks | None:
        """Start filling the grammar masks of the constrained rows of ``seqs`` (None: there are none)."""
        return self.grammar_masks.start(seqs)

    @torch.inference_mode()  # the logits are inference tensors, processed in place
    def choose_tokens(self, logits: torch.Tensor, seqs: list[SeqState], masks: PendingMasks | None) -> Chosen:
        """Each row's token after its logit processing, and the logprobs asked for."""
        return choose_controlled(logits, seqs, self.grammar_masks, masks)

    # -- forward passes -------------------------------------------------------------------------

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.finish_logits(self.model.get_output_embeddings()(hidden)).float()

    @torch.inference_mode()
    def prefill(
        self,
        tables: Sequence[list[int]],
        token_lists: Sequence[Sequence[int]],
        cached: Sequence[int] | None = None,
        slots: Sequence[int] | None = None,
        head: PrefillHead | None = None,
    ) -> PrefillResult:
        """Run sequences (``tables``: each one's blocks, enough for every token) whose first
        ``cached[b]`` tokens the pool holds already (a cached prefix; default none) and whose
        other tokens are ``token_lists[b]``: those are packed without padding into forwards of at
        most :data:`PREFILL_CHUNK_TOKENS`, their K/V written into the pool, attending to the cached
        ones in place; ``slots``: each row's adapter slot (-1: the base model). Returns next-token
        logits ``[B, vocab]`` (float32; ``head``'s rows where given) in the order given, with the
        tokens computed (padding included). Rows go into forwards in order."""
        cached = list(cached) if cached is not None else [0] * len(token_lists)
        slots = list(slots) if slots is not None else [-1] * len(token_lists)
        chunks = prefill_forwards([len(t) for t in token_lists], PREFILL_CHUNK_TOKENS)
        parts = [self._prefill_packed(rows, tables, token_lists, cached, slots, head) for rows in chunks]
        logits = torch.cat([p[0] for p in parts])
        return PrefillResult(logits, computed_tokens=sum(p[1] for p in parts), forwards=len(chunks))

    def _prefill_packed(
        self,
        prompts: list[int],
        all_tables: Sequence[list[int]],
        all_tokens: Sequence[Sequence[int]],
        all_cached: list[int],
        all_slots: list[int],
        head: PrefillHead | None,
    ) -> tuple[torch.Tensor, int]:
        """One forward over the uncached tokens of the prefill's ``prompts`` laid end to end
        (``[1, N]``); attention unpacks them to one row per prompt, each attending causally to its
        own tokens, cached ones included. Returns the logits (or head's rows) and the tokens computed."""
        tables, token_lists = [all_tables[i] for i in prompts], [all_tokens[i] for i in prompts]
        cached, slots = [all_cached[i] for i in prompts], [all_slots[i] for i in prompts]
        real = sum(len(t) for t in token_lists)
        # padding, if any, is one more prompt of pad tokens whose K/V go to the scratch block
        pad = prefill_padded_size(real) - real if self.pad_prefill else 0
        lengths = torch.tensor([len(t) for t in token_lists] + ([pad] if pad else []))
        rows, width = len(lengths), int(lengths.max())
        table = padded_tables(tables, self.scratch_block, min_width=-(-pad // self.block_size))
        if pad:
            table = torch.cat([table, torch.full((1, table.shape[1]), self.scratch_block)])
        packed = [t for tokens in token_lists for t in tokens] + [self.pad_token_id] * pad
        context = cached + [0] * bool(pad) if any(cached) else None
        ids, positions, last, meta = prefill_step(
            self.store, self.upload, table, lengths, torch.tensor(packed), self.use_prefill_kernel, context
        )
        compiled = self.compiled_prefill is not None and rows >= 2 and width >= 2  # 0/1: specialised
        adapters = (
            torch.tensor(slots + [-1] * bool(pad)).repeat_interleave(lengths)
            if any(s >= 0 for s in slots)
            else None
        )
        hidden = self.forward(ids, positions, meta, compiled and context is None, adapters)
        last = last[: len(token_lists)]
        if head is None:
            return self.logits(hidden[0, last]), real + pad
        return head(hidden[0], last, [len(t) for t in token_lists], prompts), real + pad

    @torch.inference_mode()
    def decode(
        self,
        block_tables: Sequence[list[int]],
        lengths: Sequence[int],
        last_tokens: Sequence[int],
        slots: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """One step for sequences whose newest token is not yet in the cache (``lengths`` count
        it, its slot already in the table; ``slots``: each row's adapter slot, -1 none); returns
        next-token logits ``[B, vocab]`` (float32)."""
        batch = len(block_tables)
        adapted = slots is not None and any(s >= 0 for s in slots)
        if self.graphs is not None and self.graphs.captured and not adapted:
            tables = padded_tables(block_tables, self.scratch_block)
            graphed = self.graphs.run(tables, torch.tensor(list(lengths)), torch.tensor(last_tokens))
            if graphed is not None:
                return graphed
        padded = self.pad_decode_batches and batch <= self.decode_buckets[-1]
        compiled = padded and self.compiled_decode is not None
        rows = next(b for b in self.decode_buckets if b >= batch) if padded else batch
        # a table at least two blocks wide: a width of 1 would be specialised by the compiler
        tables = padded_tables(block_tables, self.scratch_block, min_width=2 if padded else 1)
        stored = torch.tensor(list(lengths), dtype=torch.long)
        tokens = torch.tensor(last_tokens, dtype=torch.long)
        pad = rows - batch
        if pad:  # padding rows: one token each, in the scratch block
            tables = torch.cat([tables, torch.full((pad, tables.shape[1]), self.scratch_block)])
            stored = torch.cat([stored, torch.ones(pad, dtype=torch.long)])
            tokens = torch.cat([tokens, torch.full((pad,), self.pad_token_id, dtype=torch.long)])
        ids, positions, meta = decode_step(
            self.store, self.upload, tables, stored, tokens, self.use_kernel, self.use_triton
        )
        adapters = torch.tensor(list(slots or []) + [-1] * pad) if adapted else None
        hidden = self.forward(ids, positions, meta, compiled, adapters)
        return self.logits(hidden[:batch, -1])

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        meta: attention.StepMetadata,
        compiled: bool = False,
        adapters: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The model's last hidden states; ``adapters``: each token row's adapter slot."""
        if self.lora is not None:
            self.lora.step.rows = adapters  # read by the adapted linears during this forward
        try:
            return self._hidden(input_ids, position_ids, meta, compiled)
        finally:
            if self.lora is not None:
                self.lora.step.rows = None

    def _hidden(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        meta: attention.StepMetadata,
        compiled: bool,
    ) -> torch.Tensor:
        if self.lean is not None:
            return self.lean(input_ids, position_ids, meta)
        model = self.model.base_model
        if compiled and meta.is_prefill:
            model = self.compiled_prefill
        elif compiled:
            model = self.compiled_decode
            if meta.block_tables is not None:
                torch._dynamo.mark_dynamic(meta.block_tables, 1)  # context grows: no recompile per block
                if meta.mask is not None:
                    torch._dynamo.mark_dynamic(meta.mask, 3)
        token = CURRENT_STEP.set(meta)  # for layers that drop the keyword on the way to attention
        try:
            out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, tokenfleet_step=meta)
        finally:
            CURRENT_STEP.reset(token)
        return out.last_hidden_state

    def warm_up(self) -> float:
        """Compile and capture before serving (:func:`~tokenfleet.engines.native.compiled.warm_up`)."""
        return warm_up(self)
