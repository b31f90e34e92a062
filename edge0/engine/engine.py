"""The engine: a loaded model's prefill and decode loop with streamed experts, sampling and stop
strings. `edge0.engine.load.open_engine` builds one; features attach through `use_prerouter`,
`use_lora` and the StepHooks interface (hooks.py)."""

from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from edge0.backend import core as B
from edge0.backend import io as bio
from edge0.backend import modules as bmod
from edge0.backend import vision as bvision
from edge0.engine.batch import Batch, batch_problem
from edge0.engine.diagnostics import decode_logits, logits, observe_routes, prerouted_logits
from edge0.engine.generate_batch import check_batch, generate_batch
from edge0.engine.hooks import StepHooks
from edge0.engine.kv import PromptCache
from edge0.engine.parts import Parts
from edge0.engine.prefill import Prefiller
from edge0.engine.request import Request
from edge0.engine.speculative import check_speculation
from edge0.engine.stats import engine_stats
from edge0.engine.step import Stepper
from edge0.errors import Edge0Error, ImagesRefused
from edge0.formats import detect
from edge0.store.format import manifest_hash, sha256_file
from edge0.store.promptcache import DiskPromptCaches
from edge0.units import format_size
from edge0.version import __version__


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    finish_reason: str
    stats: dict = field(default_factory=dict)


class TemplateFailed(Edge0Error):
    """The chat template raised on a conversation (it refused it, or jinja's sandbox refused the
    template): the server answers 400, the CLI names the template's file."""


class Engine:
    """A loaded model. generate / stream_generate / chat; see docs/engine-api.md."""

    def __init__(self, root: Path, model, tokenizer, store, streaming, spec, k, compute_dtype, stage=None):
        self.root = Path(root)
        self.model_id = self.root.name
        self.model = model
        self.model_type = getattr(model, "model_type", "") or "unknown"  # the mlx-lm family
        self.tokenizer = tokenizer
        # The family's chat format (edge0/formats): its end-of-turn tokens end every generation, and
        # the special tokens its parser reads stay in the text
        self.chat_format = detect(tokenizer)
        for token in self.chat_format.end_tokens:
            tokenizer.add_eos_token(token)
        # Chat-format control tokens a model may sample (<|im_start|>): generated, never shown as text.
        self.control_ids = bio.control_token_ids(tokenizer, self.chat_format.markers())
        self.store = store
        self.streaming = streaming
        self.spec, self.k, self.compute_dtype = spec, k, compute_dtype
        self.resident_bytes = bmod.resident_bytes(model)
        o = streaming.options
        self.kv = PromptCache(model, o.kv_bits, o.kv_group_size)
        # layer-major prefill spans; across ranks each stage runs its own layers of a span that way
        # where mlx-lm pipelines the family, else the span goes chunk by chunk (distributed/)
        self.prefiller = Prefiller(model, compute_dtype, o.prefill_span, stage=stage)
        # every decode step runs there (step.py), with the step hooks: the pre-router's stager
        # once attached, or a test's oracle
        self.stepper = Stepper(model, streaming, StepHooks())
        # the pre-router, when attached (use_prerouter)
        self.prerouting = None
        self.heads_path: Path | None = None
        self.heads_meta: dict | None = None
        # the recovery adapter, when attached (use_lora); lora_note says why the store's is not served
        self.lora_path: Path | None = None
        self.lora_meta: dict | None = None
        self.lora_note = ""
        self.speculation = None  # speculative decoding, when a drafter is attached (use_speculation)
        self.batch_speculation = None  # the same drafter for a batch's rows, its own switch
        self.generating = False  # a stream_generate is running (resizing the expert cache waits for its end)
        # across ranks (edge0.distributed): this rank's stage, and its end of the stage exchange
        self.stage = stage
        self.pipeline = None
        self.tower = None  # a VL store's vision tower (use_tower); tower_note says why a VL model has none
        self.tower_note = ""

    def parts(self) -> Parts:
        """The parts the generation loop, the diagnostics and the pipeline use, as they are now."""
        return Parts(
            model_id=self.model_id,
            model=self.model,
            tokenizer=self.tokenizer,
            control_ids=self.control_ids,
            kv=self.kv,
            prefiller=self.prefiller,
            stepper=self.stepper,
            streaming=self.streaming,
            store=self.store,
            compute_dtype=self.compute_dtype,
            resident_bytes=self.resident_bytes,
            spec=self.spec,
            speculation=self.speculation,
            batch_speculation=self.batch_speculation,
            prerouting=self.prerouting,
            pipeline=self.pipeline,
        )

    # -- features ------------------------------------------------------------------------------
    hooks = property(
        lambda self: self.stepper.hooks,
        lambda self, hooks: setattr(self.stepper, "hooks", hooks),
        doc="The step hooks features attach (StepHooks; the stepper calls them).",
    )

    def use_prerouter(self, prerouting, hooks: StepHooks, path: Path | None, meta: dict | None) -> None:
        """Route pre-routed layers with `prerouting` (already installed in the MoE blocks) and run
        `hooks` (its stager) in the generation loop."""
        self.prerouting, self.hooks = prerouting, hooks
        self.heads_path, self.heads_meta = (Path(path) if path else None), meta

    def use_speculation(self, speculator) -> None:
        """Decode with `speculator` (edge0.engine.speculative.Speculator): drafts verified in one
        multi-token step; None goes back to plain steps. Outputs do not change."""
        if speculator is not None:
            check_speculation(self)
        self.speculation = speculator
        self.batch_speculation = speculator.for_batches() if speculator is not None else None

    def use_lora(self, path: Path, meta: dict) -> None:
        """Record the adapter whose LoRALinear layers now wrap the model's targets."""
        self.lora_path, self.lora_meta, self.lora_note = Path(path), meta, ""

    def no_lora(self, why: str) -> None:
        """Record why the store's adapter is not served (shown in describe())."""
        self.lora_note = why

    # -- ranks ---------------------------------------------------------------------------------
    @property
    def follower(self) -> bool:
        """A rank other than 0 of a distributed engine: it runs `follow()`, never generates."""
        return self.pipeline is not None and not self.pipeline.leads

    def follow(self) -> None:
        """On a follower rank: run the forwards rank 0 sends until rank 0 closes its engine."""
        if not self.follower:
            raise Edge0Error("follow() runs on the ranks other than 0 of an engine started under mlx.launch")
        self.pipeline.follow()

    def _leads(self) -> None:
        if self.follower:
            s = self.pipeline.stage
            raise Edge0Error(
                f"rank {s.rank} of {s.size} follows rank 0, which generates; call engine.follow() on this rank"
            )

    def _one_process(self, what: str) -> None:
        if self.pipeline is not None:
            raise Edge0Error(f"{what} runs in one process; a model across ranks runs generations (and decode_logits)")

    # -- prompts -------------------------------------------------------------------------------
    def encode(self, prompt) -> list[int]:
        tokens = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not tokens:
            raise Edge0Error("prompt is empty; pass some text or token ids")
        return tokens

    def chat_prompt(self, messages, tools=None, **template_kwargs) -> list[int]:
        """Token ids of `messages` rendered with the tokenizer's chat template; `template_kwargs`
        go to the template (e.g. enable_thinking)."""
        kwargs = {"tools": tools} if tools else {}
        try:
            return list(
                self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs, **template_kwargs)
            )
        except Exception as e:  # noqa: BLE001 - a template is code: it refused these messages, or the sandbox refused it
            raise TemplateFailed(f"the chat template failed ({type(e).__name__}: {e})") from None

    @property
    def takes_images(self) -> bool:
        return self.tower is not None

    def image_prompt(self, prompt, images):
        """A prompt (text, or token ids) whose chat template put one image placeholder per image
        (`images`: each one's bytes, in order), through the family's processor: its tokens, each
        image's expanded (the tower's features are computed when it is prefilled)."""
        if self.tower is None:
            why = f" ({self.tower_note})" if self.tower_note else ""
            raise ImagesRefused(f"{self.model_id}: this model does not take images{why}; send text only")
        pixels = []
        for i, data in enumerate(images):
            try:
                pixels.append(bvision.decode_image(data))
            except ValueError as e:
                raise ImagesRefused(f"image {i + 1}: {e}; send a PNG, JPEG, GIF or WebP image", i) from None
        text = prompt if isinstance(prompt, str) else self.tokenizer.decode(list(prompt), skip_special_tokens=False)
        try:
            return self.tower.prompt(text, list(images), pixels)
        except Edge0Error as e:
            raise ImagesRefused(str(e)) from None

    def template_file(self) -> Path:
        """The file the store's chat template is read from (for errors a person fixes)."""
        own = self.root / "chat_template.jinja"
        return own if own.exists() else self.root / "tokenizer_config.json"

    def chat(self, messages, tools=None, **kwargs) -> GenerationResult:
        return self.generate(self.chat_prompt(messages, tools), **kwargs)

    # -- generation ----------------------------------------------------------------------------
    def reset_cache(self) -> None:
        """Drop the last request's KV cache (the next request does not continue it)."""
        self.kv.drop_newest()

    # -- prompt caches on disk -------------------------------------------------------------------
    def identity(self) -> str:
        """sha256 of everything this engine's KV cache depends on: edge0's version, the store
        (manifest hash), compute dtype, serving K, pre-router heads and adapter files, the
        substitution alpha (which changes outputs) and the KV cache's quantization."""
        ident = {
            "edge0": __version__,
            "store": manifest_hash(self.root),
            "dtype": self.compute_dtype,
            "top_k": self.k,
            "prerouter": sha256_file(self.heads_path) if self.prerouting is not None else None,
            "lora": sha256_file(self.lora_path) if self.lora_path else None,
            "substitute_alpha": self.streaming.options.substitute_alpha,
        }
        if self.kv.kv_bits:  # only then, so float caches saved before keep their identity
            ident["kv_cache"] = {"bits": self.kv.kv_bits, "group_size": self.kv.kv_group_size}
        if self.stage is not None:  # a pipeline rank's share of a conversation (rank 0's: placeholders too)
            ident["stage"] = [self.stage.rank, self.stage.size, self.stage.start, self.stage.end]
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()

    def use_prompt_cache_dir(self, path, max_bytes: int) -> None:
        """Save finished conversations' KV caches under `path` (at most `max_bytes`, least recently
        used removed first) and reuse them, in this or a later process, when a prompt extends one."""
        self.kv.use_disk(DiskPromptCaches(path, self.identity(), max_bytes))

    def flush_prompt_caches(self) -> int:
        """Before the process ends, between generations: every conversation's KV cache held in memory
        and not on disk yet goes to the prompt-cache dir, if one is set; returns how many were saved."""
        return self.kv.flush()

    def persist_prompt_cache(self) -> bool:
        """Save the KV cache of the last generation (with reuse_cache) to the prompt-cache dir, if
        one is set and it holds tokens not saved yet; returns whether it saved. Between generations."""
        return self.kv.persist()

    def stream_generate(
        self,
        prompt,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop=None,
        reuse_cache: bool = False,
        ignore_eos: bool = False,
        should_stop=None,
        top_k: int = 0,
        logits_processors=None,
        logprobs: int | None = None,
        cache_namespace: str = "",
        images=(),
    ):
        """Yield one Step per generated token; the last Step carries finish_reason and stats.

        `should_stop()`, if given, is checked between the prefill's layers and chunks and between
        decode steps; once it returns True the generator ends without a final Step. A stop during
        prefill keeps the prompt's spans already fed into every layer in the KV cache (with
        reuse_cache, the same prompt again prefills only the rest); recurrent caches are dropped.
        `logits_processors` and `logprobs`: see edge0/engine/sampler.py. `cache_namespace`: with
        reuse_cache, only prompt caches of this namespace are reused (edge0/engine/kv.py). `images`:
        each image's bytes, in the order of the prompt's image placeholders (image_prompt)."""
        self._leads()
        vision = self.image_prompt(prompt, images) if images else None
        tokens = vision.tokens if vision is not None else self.encode(prompt)
        request = Request(
            vision.tokens if vision is not None else tokens,
            max_tokens,
            temperature,
            top_p,
            top_k,
            seed,
            stop,
            list(logits_processors or []),
            logprobs,
            ignore_eos,
            reuse_cache,
            cache_namespace,
            vision,
        )
        request.check()
        finished = False
        with self.batching() as batch:  # a lone request is a batch of one (batch.py)
            batch.interrupt = should_stop
            seq = batch.join(request)
            while not finished:
                made = batch.advance()
                for _, step in made:
                    if isinstance(step, Exception):
                        raise step
                    finished = bool(step.finish_reason)
                    yield step
                # nothing made: should_stop() stopped the prefill (the batch's interrupt)
                if not finished and should_stop and (not made or should_stop()):
                    batch.leave(seq)
                    return
        # Reached only by a caller that iterates past the last Step (generate(), the chat REPL), so
        # the reply is out before the save; the server, which closes early, saves between requests.
        self.persist_prompt_cache()

    def generate(self, prompt, max_tokens: int = 256, **kwargs) -> GenerationResult:
        """Run to completion; returns text, generated token ids, finish_reason and stats."""
        parts, tokens, last = [], [], None
        for last in self.stream_generate(prompt, max_tokens, **kwargs):
            parts.append(last.text)
            tokens.append(last.token)
        return GenerationResult("".join(parts), tokens, last.finish_reason, last.stats)

    def generate_batch(
        self,
        prompts: list,
        max_tokens: int | list[int] = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        ignore_eos: bool = False,
    ) -> list[GenerationResult]:
        """Generate for several prompts in one batch (batch.py): each prompt's greedy tokens are
        those it gets alone; every result's stats hold the batch's (`batch`). `max_tokens`: one
        limit for all, or one per prompt."""
        self._leads()
        tokens, limits = check_batch(self, prompts, max_tokens)
        requests = [
            Request(t, m, temperature, top_p, top_k, seed, ignore_eos=ignore_eos) for t, m in zip(tokens, limits)
        ]
        for r in requests:
            r.check()
        eos = set(self.tokenizer.eos_token_ids) if not ignore_eos else set()
        seqs, stats = generate_batch(self, requests)
        return [
            GenerationResult(
                self._text(s.tokens, eos),
                s.tokens,
                s.finish,
                {"prompt_tokens": len(s.prompt), "generated_tokens": len(s.tokens), "batch": stats},
            )
            for s in seqs
        ]

    def batch_problem(self) -> str | None:
        """Why this engine cannot decode sequences together (None if it can)."""
        return batch_problem(self.parts())

    def spare_contexts(self) -> int | None:
        """How many contexts' KV caches the prompt caches' memory holds beside the newest (the
        last request's; each sequence of a batch beyond the first takes one while it runs); None:
        no KV footprint known."""
        kv = self.kv
        if not kv.context_bytes:
            return None
        return kv.pool.max_bytes // kv.context_bytes

    @contextmanager
    def batching(self):
        """A Batch (batch.py) that sequences join and leave between steps; no other generation runs
        until the block ends (resizing the expert cache waits for it, as for a generation). A
        lone sequence runs on any engine; a second one joins only where `batch_problem()` is None."""
        self._leads()
        self.generating = True
        batch = Batch(self.parts())
        try:
            self.hooks.start()
            yield batch
        finally:
            batch.close()
            self.hooks.finish()
            self.generating = False

    def _text(self, tokens: list[int], eos: set[int]) -> str:
        """The text of generated `tokens`, as stream_generate shows it (control tokens hidden,
        nothing from an end-of-sequence token on)."""
        detok = self.tokenizer.detokenizer  # a fresh copy
        for t in tokens:
            if t in eos:
                break
            if t not in self.control_ids:
                detok.add_token(t)
        detok.finalize()
        return detok.text

    # -- the expert cache --------------------------------------------------------------------------
    def expert_cache(self) -> dict:
        """The expert cache now: `slots_per_layer`, `configured_slots` (at load), `min_slots`
        (top-k: one route), `max_slots` (every expert), `slot_bytes` (one slot in every MoE layer)
        and `budget_bytes`."""
        return self.streaming.cache_info()

    def free_prompt_caches(self, nbytes: int) -> int:
        """Memory pressure, between generations: the least recently used conversations' KV caches
        leave memory (to the disk tier, if any) until `nbytes` are freed or none is left, and the
        bound stays that much lower until `restore_prompt_caches()`. Returns bytes freed. On a
        pipeline rank other than 0, whose share of each conversation rank 0's pool holds, rank 0
        is asked to free as much of this rank's share (at the next generation's end; 0 now)."""
        if self.pipeline is not None and not self.pipeline.leads:
            self.pipeline.ask_to_free(nbytes)
            return 0
        freed = self.kv.evict(nbytes)
        if freed:
            B.release_cached_memory()
        return freed

    def prompt_caches_held(self) -> int:
        """Bytes of other conversations' KV caches held in memory (the pool's, beside the newest;
        on a pipeline rank other than 0, its share of rank 0's prompt caches)."""
        if self.pipeline is not None and not self.pipeline.leads:
            return self.pipeline.replica.nbytes()
        return self.kv.pool.bytes  # the bounded entries: the newest is outside the bound

    def restore_prompt_caches(self) -> None:
        """Memory is back: the prompt caches' bound as configured again."""
        self.kv.restore_bound()

    def resize_expert_cache(self, n_slots: int) -> None:
        """Give each MoE layer `n_slots` expert slots, between generations only; outputs do not
        change (a dropped expert is read again when a route needs it), reads may."""
        if self.generating:
            raise Edge0Error("resize_expert_cache: a generation is in flight; resize between generations")
        self.streaming.resize(n_slots)

    # -- checks, evaluation and traces (diagnostics.py) ----------------------------------------
    def logits(self, prompt):
        """Float32 logits of every prompt position [T, V] (no cache; gate routing)."""
        self._one_process("logits")
        return logits(self.model, self.encode(prompt))

    def prerouted_logits(self, prompt):
        """Float32 logits [T, V] of every position, routed as decoding routes them (one pass)."""
        self._one_process("prerouted_logits")
        return prerouted_logits(self.model, self.hooks, self.encode(prompt))

    def decode_logits(self, prompt):
        """Float32 log-probs [T, V] of every position, token by token through the caches."""
        self._leads()
        return decode_logits(self.parts(), self.encode(prompt))

    def observe_routes(self, fn) -> None:
        """fn(layer, indices, scores) for every spec'd MoE layer's forward (None stops)."""
        self._one_process("route tracing")
        observe_routes(self.parts(), fn)

    # -- stats ---------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Cumulative engine statistics, with a per-layer breakdown."""
        return engine_stats(self)

    def use_tower(self, tower, note: str = "") -> None:
        """Serve images with `tower` (edge0.backend.vision.Tower), or say in `note` why not."""
        self.tower, self.tower_note = tower, note
        self.prefiller.tower = tower

    def describe(self) -> str:
        """One line about the loaded model and how its experts are streamed."""
        lora = f", LoRA {self.lora_path.name}" if self.lora_path else (f"; {self.lora_note}" if self.lora_note else "")
        rank = f"[{self.pipeline.stage.describe()}] " if self.pipeline is not None else ""
        spec = f"; {self.speculation.describe()}" if self.speculation is not None else ""
        # said only when a prompt is not fed layer by layer (each chunk then reads the experts again)
        prefill = "" if self.prefiller.layerwise else f"; {self.prefiller.describe()}"
        if self.tower is not None:
            vision = f" + vision tower {format_size(self.tower.nbytes)}"
        else:
            vision = f" ({self.tower_note})" if self.tower_note else ""
        return (
            f"{rank}{self.model_id}: {self.compute_dtype}, resident {format_size(self.resident_bytes)}{vision}, "
            f"{self.streaming.describe()}{lora}; {self.store.describe_io()}; {self.kv.describe()}{spec}{prefill}"
        )

    def close(self) -> None:
        """Release the store and reader threads (on rank 0 of a distributed engine, the other
        ranks too)."""
        if self.pipeline is not None:
            self.pipeline.close()
        self.streaming.close()
        self.store.close()
