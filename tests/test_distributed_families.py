"""Every MoE family across ranks (edge0/backend/stages.py): each fixture family on 2 ranks gives
the single process's greedy tokens or is refused on every rank with its reason (a family that is
neither fails the discovery test), hybrid and CacheList families keep each stage's own state and
reuse prefixes, and a sample runs on 3 ranks. Launches and helpers from test_distributed.py."""

import json
import sys

import pytest

import edge0
from tests.test_distributed import PROMPT, ROOT, TOKENS, launch, single

# families refused across ranks, each with its one-line reason (every other family of the fixtures
# must give the single process's tokens on 2 ranks)
REFUSED: dict[str, str] = {}
# fixtures across ranks where a family's own has nothing to cut: gemma4's 3 layers all share KV
# (layer 2 reuses layer 0's), so 5 here: layer 4 reuses layer 2's, layers 2-4 stay on one stage;
# kimi_k3 with attention residuals, whose blocks of earlier layers' sums cross each boundary
_GEMMA4 = {"num_hidden_layers": 5, "layer_types": ("sliding_attention", "full_attention") * 2 + ("sliding_attention",)}
ACROSS_RANKS = {"gemma4": _GEMMA4, "gemma4_text": _GEMMA4, "kimi_k3": {"attn_res_block_size": 2}}
# the hybrid families (linear attention or SSM state beside KV caches) and those with several caches
# in one layer (CacheList): each stage keeps its own layers' state, the exchange counts the tokens
HYBRID = (
    *("qwen3_5_moe", "qwen3_next", "kimi_linear", "granitemoehybrid", "bailing_moe_linear", "deepseek_v32"),
    *("jamba", "nemotron_h", "lfm2_moe", "longcat_flash_ngram"),  # SSM or conv state; an n-gram embedding's history
)
# a sample in the default suite (mlx-lm pipelines none of them: Edge0 stands SkipLayers in for the
# other stage's layers); every fixture family behind -m slow
SAMPLE = ("mixtral", "olmoe", "gpt_oss", "minimax", "dbrx")  # dbrx: its ends are wte, blocks, norm_f


def _alone(run: dict) -> dict:
    """A run's load options for one process (a layer split is for ranks)."""
    return {k: v for k, v in run["options"].items() if k != "pipeline_split"}


def _families_across_ranks(
    families, store_for, tmp_path, ranks=2, fixture=None, turns=(), batch=(), session=(), controlled=None, **options
):
    """Each of `families` (fixtures with `fixture` keywords) on `ranks` ranks in one launch: the
    single process's greedy tokens, each rank running its own contiguous layers, or refused on
    every rank with its REFUSED reason; then `turns`, prompts one after another reusing the KV
    cache, each as one process gives it; `batch`, prompts decoded together, each as it decodes
    alone; `session`, prompts of interleaved conversations reusing what the prompt caches kept,
    each with the tokens and the cached prompt tokens of one process running the same session;
    returns what each rank wrote, per family;
    `controlled` p: rank 0 decodes speculatively, each drafted token right with probability p
    (the verifies keep and reject drafts, and rewind every rank's caches)."""
    runs = [
        {
            "store": str(store_for(f, **{**ACROSS_RANKS.get(f, {}), **(fixture or {})})),
            "options": {"prerouter": False, **options},
        }
        for f in families
    ]
    for run in runs:
        run.update(prompt=PROMPT, max_tokens=TOKENS, ignore_eos=True, turns=list(turns))
        run.update(batch=list(batch), session=list(session))
        if controlled is not None:  # each prompt's plain greedy tokens in one process, to draft from
            one = edge0.load(run["store"], **_alone(run))
            wants = {p: one.generate(p, max_tokens=TOKENS, ignore_eos=True).tokens for p in [PROMPT, *batch]}
            run["controlled"] = [wants, controlled]
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    argv = [sys.executable, str(ROOT / "tests" / "dist_worker.py"), str(tmp_path / "runs.json")]
    argvs = [argv + [str(tmp_path / f"out-{r}.json")] for r in range(ranks)]
    done = launch(tmp_path, argvs, ranks=ranks, timeout=60 + 15 * len(runs))
    assert [rc for rc, _, _ in done] == [0] * ranks, "\n".join(err[-3000:] for _, _, err in done)
    out = [json.loads((tmp_path / f"out-{r}.json").read_text()) for r in range(ranks)]
    wrong = {}  # every family that is not as expected, named at once
    for i, family in enumerate(families):
        got = [o[i] for o in out]
        if family in REFUSED:
            if not all(REFUSED[family] in g.get("refused", "") for g in got):
                wrong[family] = ("not refused with its REFUSED reason", got[0].get("refused"))
            continue
        if "refused" in got[0]:
            wrong[family] = ("refused", got[0]["refused"])
            continue
        layers = [layer for g in reversed(got) for layer in g["layers"]]  # the last rank runs the first stage
        if not all(g["layers"] for g in got) or layers != list(range(len(layers))):
            wrong[family] = ("layers", layers)
            continue
        want, stats = single(runs[i]["store"], got[0]["layerwise"], **_alone(runs[i]))
        if got[0]["tokens"] != want:
            wrong[family] = (got[0]["tokens"], want)
        elif controlled is not None and not 0 < got[0]["speculation"]["accepted"] < got[0]["speculation"]["drafted"]:
            wrong[family] = ("speculation: drafts both kept and rejected", got[0]["speculation"])
        elif [g["layerwise"] for g in got] != [stats["alone_layerwise"]] * ranks:
            # every stage feeds its layers a span at a time wherever one process would
            wrong[family] = ("layer by layer", [g["layerwise"] for g in got], stats["alone_layerwise"])
        elif turns:
            cold = edge0.load(runs[i]["store"], **_alone(runs[i]))
            cold.prefiller.layerwise = False
            want = [cold.generate(t, max_tokens=TOKENS, ignore_eos=True).tokens for t in turns]
            if got[0]["turns"] != want:
                wrong[family] = ("turns", got[0]["turns"], want)
        if batch:
            cold = edge0.load(runs[i]["store"], **_alone(runs[i]))
            cold.prefiller.layerwise = False
            want = [cold.generate(p, max_tokens=TOKENS, ignore_eos=True).tokens for p in batch]
            if got[0]["batch"] != want or got[0]["batch_stats"]["batch_steps"] > TOKENS + 1:  # together, not in turn
                wrong[family] = ("batch", got[0]["batch"], want, got[0]["batch_stats"])
        if session:
            one = edge0.load(runs[i]["store"], **_alone(runs[i]))
            one.prefiller.layerwise = False
            want = []
            for p in session:
                r = one.generate(p, max_tokens=TOKENS, ignore_eos=True, reuse_cache=True)
                want.append({"tokens": r.tokens, "cached": r.stats["prompt_tokens"] - r.stats["prefill_tokens"]})
            # the session's later turns find their first turns in the pool (agent_session)
            if got[0]["session"] != want or not all(t["cached"] > 0 for t in got[0]["session"][3:]):
                wrong[family] = ("session", got[0]["session"], want)
    assert not wrong, wrong
    return out


def agent_session() -> list[str]:
    """An agent's requests: its main thread, a side request, a subagent sharing the system prompt,
    the main thread's next turn (which must find its first turn in the pool: two other
    conversations ran in between), and the subagent's next turn."""
    system = PROMPT * 8
    main = system + " the task: count the stars"
    sub = system + " the subtask: count the moons"
    return [main, "a short side request about a title", sub, main + " and then the planets", sub + " and the suns"]


BATCH = [PROMPT, "the sea " * 9, PROMPT + " and a dragon", "why " * 3]


def test_a_hybrid_family_batches_and_keeps_an_agent_sessions_prefixes_on_two_ranks(store_for, tmp_path):
    """Four prompts decoded together give each one's tokens alone; an agent's interleaved
    conversations each reuse what the pool kept (rank 0's prompt caches, mirrored on rank 1)."""
    _families_across_ranks(("qwen3_next",), store_for, tmp_path, batch=BATCH, session=agent_session())


@pytest.mark.slow  # one launch: plain KV, hybrid, CacheList and SSM families batched and in a session
def test_families_batch_and_keep_an_agent_sessions_prefixes_on_two_ranks(store_for, tmp_path):
    families = ("qwen3_moe", "mixtral", "gpt_oss", *HYBRID)
    _families_across_ranks(families, store_for, tmp_path, batch=BATCH, session=agent_session())


@pytest.mark.slow  # one launch
def test_deepseek_v41_resumes_a_conversation_from_its_end_of_prompt_copy_on_two_ranks(store_for, tmp_path):
    """Its caches cannot be cut back: the next turn resumes from a copy taken at the prompt's end
    (216 cached tokens here), which rank 1 takes of its own layers too. Before the prompt caches
    were mirrored the pool was off across ranks, so no copy was taken and the turn ran cold."""
    first = PROMPT * 12
    session = [first, first + " and then", "unrelated " * 20]
    _families_across_ranks(("deepseek_v41",), store_for, tmp_path, session=session)


@pytest.mark.slow  # in the default suite's time budget: every family across ranks runs under -m slow
def test_families_mlx_lm_does_not_pipeline_give_the_single_process_tokens_on_two_ranks(store_for, tmp_path):
    _families_across_ranks(SAMPLE, store_for, tmp_path)


@pytest.mark.slow  # in the default suite's time budget: ten hybrid families across ranks run under -m slow
def test_a_hybrid_family_keeps_each_stage_s_state_on_two_ranks_and_reuses_prefixes(store_for, tmp_path):
    first = PROMPT * 12
    # linear attention beside KV caches (the Qwen3.5 / 3.6 design); the other kinds under -m slow
    _families_across_ranks(("qwen3_next",), store_for, tmp_path, turns=[first, first + " and then", "unrelated " * 20])


@pytest.mark.slow  # one launch of the hybrid and CacheList families, with turns that reuse the KV cache
def test_every_hybrid_family_reuses_prefixes_on_two_ranks(store_for, tmp_path):
    first = PROMPT * 12
    _families_across_ranks(HYBRID, store_for, tmp_path, turns=[first, first + " and then", "unrelated " * 20])


@pytest.mark.slow  # one launch over every fixture family per decode executor: about 25 s each
@pytest.mark.parametrize("executor", ["staged", "exact", "hot"])
def test_every_family_gives_the_single_process_tokens_on_two_ranks_or_is_refused_with_its_reason(
    executor, store_for, tmp_path
):
    from tests.fixtures import ALL_FAMILIES

    assert set(REFUSED) <= set(ALL_FAMILIES)
    _families_across_ranks(ALL_FAMILIES, store_for, tmp_path, decode_executor=executor)


@pytest.mark.slow  # one launch of three ranks
def test_hybrid_families_on_three_ranks_keep_each_stage_s_state_and_reuse_prefixes(store_for, tmp_path):
    first = PROMPT * 12
    _families_across_ranks(
        ("qwen3_next", "qwen3_5_moe", "deepseek_v32", "jamba"),
        store_for,
        tmp_path,
        ranks=3,
        fixture={"num_hidden_layers": 4},  # a middle stage of one layer or more, both kinds of layer on some
        turns=[first, first + " and then", "unrelated " * 20],
    )


@pytest.mark.slow  # one launch of three ranks
def test_families_mlx_lm_does_not_pipeline_give_the_single_process_tokens_on_three_ranks(store_for, tmp_path):
    # three layers: the middle stage's first and last layer are the same one
    _families_across_ranks(
        ("mixtral", "olmoe", "minimax"), store_for, tmp_path, ranks=3, fixture={"num_hidden_layers": 3}
    )


def test_rank_0_with_only_recurrent_state_is_refused_naming_the_split():
    # rank 0's cache must count tokens: each forward's header tells the other ranks how many it holds
    from types import SimpleNamespace

    from mlx_lm.models.cache import ArraysCache, KVCache

    from edge0.distributed.pipeline import Pipeline
    from edge0.distributed.split import Stage
    from edge0.errors import Edge0Error

    def lead(cache):
        parts = SimpleNamespace(kv=SimpleNamespace(make=lambda: cache), compute_dtype="float32")
        Pipeline(None, Stage(0, 2, (1, 2), (0, 1, 2)), parts, dict).lead()

    with pytest.raises(
        Edge0Error, match=r"rank 0 of 2: its layers \(.*\) keep only recurrent state .* --pipeline-split"
    ):
        lead([ArraysCache(2)])
    with pytest.raises(AttributeError):  # past the check: a real pipeline's parts go on from here
        lead([ArraysCache(2), KVCache()])


def test_families_whose_layers_share_kv_or_residual_blocks_give_the_single_process_tokens_on_two_ranks(
    store_for, tmp_path
):
    """gemma4's KV-shared layers stay on the stage of the layer whose KV they reuse; kimi_k3's
    stages hand on its attention-residual blocks with the hidden state."""
    _families_across_ranks(("gemma4", "gemma4_text", "kimi_k3"), store_for, tmp_path)


@pytest.mark.slow  # one launch of three ranks
def test_families_whose_layers_share_kv_or_residual_blocks_give_the_single_process_tokens_on_three_ranks(
    store_for, tmp_path
):
    # gemma4: stages of one layer each before the run of three that shares KV
    _families_across_ranks(("gemma4_text",), store_for, tmp_path, ranks=3)
    # kimi_k3 with a block at every layer: the middle stage receives one block and sends two
    _families_across_ranks(("kimi_k3",), store_for, tmp_path, ranks=3, fixture={"attn_res_block_size": 1})


def test_speculative_decoding_on_two_ranks_gives_the_plain_greedy_tokens(store_for, tmp_path):
    """Rank 0 drafts and verifies; every rank runs the verify's forward on its layers and takes
    its caches back as rank 0 does: cut back (qwen3_moe, mixtral), or back to before the verify
    and the kept tokens fed again where some rank's layers hold recurrent state (qwen3_next: its
    linear-attention layers sit on both ranks). A batch's rows draft too, and each row drops its
    own rejected drafts on every rank."""
    families = ("qwen3_moe", "mixtral", "qwen3_next")
    out = _families_across_ranks(families, store_for, tmp_path, batch=[PROMPT, "the sea " * 9], controlled=0.6)
    assert out[0][2]["speculation"]["replays"] > 0  # qwen3_next: rejected drafts fed again on both ranks
    for i in (0, 1):  # qwen3_next's rows cannot drop their tails, in one process either: its batch does not draft
        assert 0 < out[0][i]["batch_speculation"]["accepted"] < out[0][i]["batch_speculation"]["drafted"]
    # rank 0 holds only qwen3_next's attention layer, which could be cut back, rank 1 its
    # linear-attention layers: every rank replays, as one process of the whole model does
    out = _families_across_ranks(("qwen3_next",), store_for, tmp_path, controlled=0.6, pipeline_split="1,3")
    assert out[0][0]["layers"] == [3] and out[0][0]["speculation"]["replays"] > 0
    # gpt_oss: rank 0 holds its full-attention layer, rank 1 its sliding window, which stops
    # cutting back once full (the prompt is longer than the fixture's window of 8): every rank replays
    out = _families_across_ranks(("gpt_oss",), store_for, tmp_path, controlled=0.6, pipeline_split="1,1")
    assert out[0][0]["speculation"]["replays"] > 0


def test_speculative_decoding_with_pre_router_heads_on_two_ranks_gives_one_process_s_tokens(store_for, tmp_path):
    """The heads route the next token on both ranks (3 layers, rank 1 holding layers 0 and 1, so
    head 0 stages rank 1's layer 1 and head 1 sends rank 0 its prediction for layer 2). After a
    verify, rank 0 tells rank 1 which of its positions was kept (StepHooks.kept): the head's
    prediction there is what rank 1 stages for its next step."""
    from edge0.prerouter.train import train, write

    store = store_for("qwen3_moe", num_hidden_layers=3)
    text = "Once upon a time there was a tiny model that read its experts from disk. " * 40
    engine = edge0.load(store, prerouter=False)
    tensors, meta, _ = train(engine, text, data_name="test", window=64, steps=40, progress=False)
    heads = write(tmp_path / "heads.safetensors", tensors, meta)
    out = _families_across_ranks(
        ("qwen3_moe",),
        store_for,
        tmp_path,
        fixture={"num_hidden_layers": 3},
        controlled=0.6,
        prerouter=str(heads),
        pipeline_split="1,2",
    )
    assert out[1][0]["layers"] == [0, 1] and out[0][0]["speculation"]["verifies"] > 0
    assert sum(out[0][0]["prerouter"]["routed_by_head"].values()) > 0


def test_the_disk_tier_on_two_ranks_keeps_each_rank_s_share_across_a_restart(store_for, tmp_path):
    """Each rank saves its layers' share of a conversation in its own folder of the prompt-cache
    dir; after both ranks restart, the next turn restores every share (qwen3_moe: the cached tokens
    of one process that restarted the same way; qwen3_next's caches cannot be cut back to the new
    prompt's prefix, so it prefills, as one process does). A share missing on rank 1 makes rank 0
    drop its file and prefill, with the tokens unchanged."""
    import shutil

    first = PROMPT * 12
    tier = {"prompt_cache_dir": str(tmp_path / "prompt-caches")}
    families = ("qwen3_moe", "qwen3_next")
    out = _families_across_ranks(families, store_for, tmp_path, session=[first], **tier)
    assert all(o[i]["prompt_cache"]["saved"] == 1 for o in out for i in range(2))  # every rank saved its share
    out = _families_across_ranks(families, store_for, tmp_path, session=[first + " and then"], **tier)
    assert out[0][0]["session"][0]["cached"] > 0  # restored from disk, on both ranks
    assert [o[0]["prompt_cache"]["restored"] for o in out] == [1, 1]
    for folder in (tmp_path / "prompt-caches").iterdir():  # all but rank 0's shares go
        if folder.is_dir() and folder.name not in {out[0][i]["prompt_cache"]["identity"] for i in range(2)}:
            shutil.rmtree(folder)
    out = _families_across_ranks(families, store_for, tmp_path, session=[first + " and then"], **tier)
    assert out[0][0]["session"][0]["cached"] == 0 and out[0][0]["prompt_cache"]["incomplete"] == 1
