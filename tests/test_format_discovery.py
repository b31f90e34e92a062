"""Every MoE model module of the installed mlx-lm has a chat format: the format cases its checkpoints'
published templates render (FORMATS, case names from tests/fixtures/formats), a format Edge0 has no
parser for yet (UNSUPPORTED: such a model chats, and requests with tools get a 400), or a documented
reason it has none (NO_FORMAT). A module mlx-lm adds must be classified here; a module it drops must
leave. The comment above an entry says where the fact came from."""

from __future__ import annotations

import re
import warnings

from tests.fixtures.formats import cases
from tests.test_token_identity import mlx_lm_moe_modules

FORMATS: dict[str, tuple[str, ...]] = {
    # Trinity-Large-Thinking: its model card serves it with vLLM `--tool-call-parser qwen3_coder`;
    # Trinity-Mini: SGLang's `trinity` detector is Qwen2.5's `<tool_call>` JSON (function_call/trinity_detector.py).
    "afmoe": ("qwen3_coder", "json_tools"),
    # Ling/Ring-2.5, 2.6 (BailingMoeV2_5, model_type bailing_hybrid): SGLang's Ling-2.6-flash recipe,
    # `--tool-call-parser qwen25`.
    "bailing_hybrid": ("json_tools",),
    # Ling/Ring-2.0 (mini, flash, 1T): a bailingmoev2 template in an ik_llama.cpp issue log renders
    # `<tool_call>\n{"name": tool_call.name, "arguments": ...}\n</tool_call>` in `<role>ASSISTANT</role>` turns.
    "bailing_moe": ("json_tools",),
    # Ring-mini/flash-linear-2.0, trained from Ling-flash-base-2.0: Ring-2.0's template (assumed, not read).
    "bailing_moe_linear": ("json_tools",),
    # Ling 3 (BailingMoeV3: KDA + MLA): vLLM's vllm/parser/ling3.py, "the same XML tool-call format as GLM-4.7".
    "bailing_moe_v3": ("glm47",),
    # DeepSeek-V2.5: the DeepSeek-V2 README's "Function calling", `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function
    # <｜tool▁sep｜>NAME` and a ```json fence, tools listed in the system prompt (V2-Lite-Chat, Coder-V2: no tools).
    "deepseek_v2": ("deepseek_v31",),
    # DeepSeek-V3, V3.1, R1 (docs/clients.md); Kimi-K2 (model_type kimi_k2, remapped to this module) and GigaChat3.
    "deepseek_v3": ("deepseek_v31", "kimi_k2", "gigachat3"),
    "deepseek_v32": ("deepseek_v32",),  # DeepSeek-V3.2 (docs/clients.md)
    # K-EXAONE-236B-A23B: its README serves it with vLLM `--tool-call-parser hermes --reasoning-parser deepseek_v3`.
    "exaone_moe": ("json_tools",),
    "gemma4": ("gemma4",),  # Gemma 4 26B-A4B (docs/clients.md)
    "gemma4_text": ("gemma4",),
    "glm4_moe": ("glm47",),  # GLM-4.5, 4.6, 4.7 (docs/clients.md)
    "glm4_moe_lite": ("glm47",),  # GLM-4.7-Flash: vLLM's docs/features/tool_calling.md, `glm47`
    "glm_moe_dsa": ("glm47",),  # GLM-5: served with SGLang `--tool-call-parser glm47` (swiss-ai serving config)
    "gpt_oss": ("harmony",),
    # Granite-4.0-H (tiny, small): vLLM's docs name `granite4`, whose parser reads Hermes `<tool_call>{...}</tool_call>`
    # (vllm/tool_parsers/granite4_tool_parser.py).
    "granitemoehybrid": ("json_tools",),
    "kimi_k25": ("kimi_k2",),  # Kimi-K2.5 (docs/clients.md)
    "kimi_k3": ("kimi_k3",),
    # Kimi-Linear-48B-A3B-Instruct: served with a kimi_k2 parser (cubist38/mlx-openai-server PR #184).
    "kimi_linear": ("kimi_k2",),
    "laguna": ("laguna",),
    "lfm2_moe": ("pythonic",),
    "llama4": ("llama4",),
    # MiMo-V2-Flash: vLLM registers `mimo` as its Qwen3-Coder parser; SGLang's MiMoDetector documents
    # `<tool_call>\n<function=NAME>\n<parameter=K>V</parameter>...`.
    "mimo_v2_flash": ("qwen3_coder",),
    "minimax": ("minimax_m2",),  # MiniMax-M2, M2.1, M2.5 (model_type minimax_m2, remapped to this module)
    "mistral3": ("mistral3",),
    # Mistral Small 4 (the Mistral4 text backbone): Mistral's tekken template, as Large 3's (assumed, not read).
    "mistral4": ("mistral3",),
    "mixtral": ("mistral",),  # Mixtral-8x22B-Instruct (v3 tokenizer); Mixtral-8x7B-Instruct declares no tools
    # Nemotron-3-Nano-30B-A3B (docs/clients.md); the dense Nemotron-Nano-v2 this module also loads write `<TOOLCALL>`.
    "nemotron_h": ("qwen3_coder",),
    "prism_hadamard_qwen35": ("qwen3_coder",),  # a Qwen3.5 pack: Qwen3.5's template
    "qwen3_5": ("qwen3_coder",),
    "qwen3_5_moe": ("qwen3_coder",),
    "qwen3_moe": ("json_tools", "qwen3_coder"),  # Qwen3-30B-A3B, 235B-A22B; Qwen3-Coder-30B-A3B, 480B-A35B
    # Qwen3-Next-80B-A3B, Qwen3-VL-30B-A3B/235B-A22B: SGLang's tool parser docs name `qwen` (Qwen2.5's JSON) for them.
    "qwen3_next": ("json_tools",),
    "qwen3_vl_moe": ("json_tools",),
    "solar_open": ("solar_open",),
    # Step-3.5-Flash: vLLM's step3p5 parser reads `<tool_call><function=..><parameter=..>`; StepFun3.7-Flash.jinja in
    # llama.cpp's models/templates renders `<tool_call>\n<function=NAME>` (mlx-lm infers qwen3_coder from it).
    "step3p5": ("qwen3_coder",),
}

UNSUPPORTED: dict[str, str] = {
    # DeepSeek-V4.1: vLLM's vllm/parser/deepseek_v41.py ("spaced DSML"); deepseek_v32 reads unspaced DSML only.
    "deepseek_v41": (
        'format deepseek_v41 (markup <｜DSML｜ calls><｜DSML｜ invoke name="NAME"><｜DSML｜ parameter name="K" '
        'string="true">V</｜DSML｜ parameter></｜DSML｜ invoke></｜DSML｜ calls>, <think>): no parser yet'
    ),
    # ERNIE-4.5-21B-A3B-Thinking: vLLM's ernie45 parser (vllm/tool_parsers/ernie45_tool_parser.py); the templates of
    # ERNIE-4.5-21B-A3B-PT and 300B-A47B-PT were not read.
    "ernie4_5_moe": (
        'format ernie45 (markup <tool_call>{"name", "arguments"}</tool_call> after </think>, an answer wrapped in '
        "<response>...</response>): no parser yet"
    ),
    # Granite-3.0/3.1 1B-A400M, 3B-A800M: vLLM's granite parser (vllm/tool_parsers/granite_tool_parser.py).
    "granitemoe": (
        'format granite (markup <|tool_call|>[{"name", "arguments"}, ...], Granite 3.1: the text <tool_call> '
        "then the list, no closing tag): no parser yet"
    ),
    # Hunyuan-A13B-Instruct: vLLM's hunyuan_a13b parser (vllm/tool_parsers/hunyuan_a13b_tool_parser.py, its docs).
    "hunyuan": (
        'format hunyuan_a13b (markup <tool_calls>[{"name", "arguments"}, ...]</tool_calls>, reasoning '
        "<think>...</think> then <answer>...</answer>): no parser yet"
    ),
    # AI21-Jamba-1.5/1.6/1.7 Mini, Large: vLLM's jamba parser (vllm/tool_parsers/jamba_tool_parser.py, its docs).
    "jamba": 'format jamba (markup <tool_calls>[{"name", "arguments"}, ...]</tool_calls>): no parser yet',
    # MiniMax-M3: vLLM's minimax_m3 parser (vllm/tool_parsers/minimax_m3_tool_parser.py); not M2's <minimax:tool_call>.
    "minimax_m3_vl": (
        'format minimax_m3 (markup ]<]minimax[>[<tool_call>]<]minimax[>[<invoke name="NAME">]<]minimax[>[<K>V'
        "]<]minimax[>[</K>...]<]minimax[>[</tool_call>, every tag namespaced): no parser yet"
    ),
}

NO_FORMAT: dict[str, str] = {
    # LongCat-Flash-Chat, -Thinking: vLLM's tool-calling docs, `longcat`; mlx-lm infers its `longcat` parser from
    # `<longcat_tool_call>` in the template (tokenizer_utils._infer_tool_parser), so Edge0 serves it through that
    # parser, untested: the published template a case needs (how a call and its result render) was not found.
    "longcat_flash": (
        "unverified: mlx-lm's longcat parser reads its <longcat_tool_call> calls, but the published template "
        "(how history renders them) was not found, so there is no case"
    ),
    "longcat_flash_ngram": "unverified: LongCat-Flash's format (above), with the same missing template",
    # edge0/families REFUSED: mlx-lm runs its attention only through a Metal kernel.
    "muse_spark": (
        "none: Edge0 does not load Muse Spark checkpoints (edge0/families REFUSED); its <atem:function_calls> "
        "in harmony-like headers would need a format module of its own"
    ),
    # Kwai-Klear's README: plain chat through transformers and its vLLM fork, no tool parser or tool example.
    "Klear": "none: Klear-46B-A2.5B-Instruct's card shows plain chat only and names no tool format",
    # The next four: the published templates as recalled, not re-read this round.
    "dbrx": "none: dbrx-instruct's ChatML template declares no tool calls; plain chat only",
    "deepseek": "none: deepseek-moe-16b-chat's User:/Assistant: template declares no tool calls; plain chat only",
    "olmoe": "none: OLMoE-1B-7B-Instruct's Tulu template declares no tool calls; plain chat only",
    "phimoe": "none: Phi-3.5-MoE-instruct's template declares no tool calls; plain chat only",
    # llama.cpp's llm_chat_detect_template (LLM_CHAT_TEMPLATE_DOTS1) and ms-swift's dots1 template: plain turns.
    # (vLLM's `dots` parser, <dots_function_call>, is dots-3's, an API model.)
    "dots1": "none: dots.llm1.inst's <|userprompt|>...<|response|> template declares no tool calls; plain chat only",
    # ms-swift's KimiVLTemplate (Moonlight's template meta); the checkpoint's own template not read.
    "kimi_vl": "none: Kimi-VL-A3B-Instruct/-Thinking's template renders plain turns, no tool calls; plain chat only",
    # Its card names vLLM tool and reasoning parsers (an Ollama-based project's note), not found here.
    "mellum": (
        "unverified: Mellum2-12B-A2.5B-Instruct/-Thinking call tools, but neither their template nor the parser "
        "their card names was found; classify once read"
    ),
    "phixtral": "none: community merges of phi-2 models (phixtral-2x2_8, 4x2_8) with no chat template of their own",
    # QwenLM/Qwen3 issue #805: Qwen2's official function calling is Qwen-Agent's prompt, not the template.
    "qwen2_moe": (
        "none: Qwen1.5-MoE-A2.7B-Chat's and Qwen2-57B-A14B-Instruct's ChatML templates declare no tool calls; "
        "plain chat only"
    ),
}


def test_every_mlx_lm_moe_module_is_classified():
    found = mlx_lm_moe_modules()
    classified = [set(FORMATS), set(UNSUPPORTED), set(NO_FORMAT)]
    assert not (classified[0] & classified[1] or classified[0] & classified[2] or classified[1] & classified[2])
    missing = sorted(found - set().union(*classified))
    assert missing == [], (
        f"mlx-lm MoE modules with no chat format classified in tests/test_format_discovery.py: {missing} "
        "(add each to FORMATS, UNSUPPORTED or NO_FORMAT, with where the fact came from)"
    )
    gone = sorted(set().union(*classified) - found)
    assert gone == [], f"entries for modules the installed mlx-lm no longer has: {gone}"


def test_every_mapped_format_is_a_case():
    names = {c.name for c in cases()}
    unknown = sorted(f"{module} -> {name}" for module, fmts in FORMATS.items() for name in fmts if name not in names)
    assert unknown == [], f"formats with no case in tests/fixtures/formats (cases: {sorted(names)}): {unknown}"
    assert all(isinstance(fmts, tuple) and fmts for fmts in FORMATS.values())


def test_formats_without_a_parser_are_reported():
    bad = [m for m, why in UNSUPPORTED.items() if not re.fullmatch(r"format \S+ \(markup .+\): no parser yet", why)]
    bad += [m for m, why in NO_FORMAT.items() if not why.startswith(("none: ", "unverified: "))]
    assert bad == [], f"reasons not in the documented form: {bad}"
    report = [f"{m}: {why}" for m, why in sorted(UNSUPPORTED.items())]
    report += [f"{m}: {why}" for m, why in sorted(NO_FORMAT.items()) if why.startswith("unverified")]
    warnings.warn(
        "mlx-lm MoE modules whose checkpoints' tool format Edge0 cannot parse (tools refused):\n  "
        + "\n  ".join(report),
        stacklevel=1,
    )
