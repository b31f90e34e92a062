"""`edge0 train-lora`: train a recovery LoRA for a store, distilled from its full-precision teacher
along the store's own serving route (int4 experts streamed, pre-router at --top-k)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import edge0
from edge0.cli.common import OneLineParser, read_text, run_main
from edge0.errors import Edge0Error


def _parser() -> argparse.ArgumentParser:
    from edge0.lora.train import TrainOptions

    d = TrainOptions()
    p = OneLineParser(prog="edge0 train-lora", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="edge0 store (default: the bundled demo model)")
    p.add_argument(
        "--teacher", required=True, help="full-precision Hugging Face / mlx-lm checkpoint the store was converted from"
    )
    p.add_argument(
        "--data",
        required=True,
        help="text (.txt) or JSONL with a text field: prompts are drawn from it, its tail is held out",
    )
    p.add_argument(
        "--out", required=True, help="adapter to write (put it in the store as lora.safetensors to use it by default)"
    )
    p.add_argument("--top-k", type=int, default=None, help="serving width K to train for (default: the model's)")
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--prerouter",
        default=None,
        metavar="FILE",
        help="pre-router heads (default: the store's prerouter.safetensors, if any)",
    )
    g.add_argument("--no-prerouter", action="store_true", help="train for gate routing")
    p.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"], help="student compute dtype"
    )
    p.add_argument("--r", type=int, default=d.r, help=f"LoRA rank (default {d.r})")
    p.add_argument(
        "--alpha", type=float, default=d.alpha, help=f"LoRA alpha; the delta is scaled by alpha/r (default {d.alpha:g})"
    )
    p.add_argument(
        "--targets",
        default=None,
        help="comma-separated module names or paths, e.g. q_proj,o_proj (default: every "
        "attention, shared-expert and dense-MLP linear)",
    )
    p.add_argument(
        "--sft-steps", type=int, default=d.sft_steps, help=f"phase 1 steps, SFT on teacher text (default {d.sft_steps})"
    )
    p.add_argument(
        "--distill-steps",
        type=int,
        default=d.distill_steps,
        help=f"phase 2 steps, on-policy distillation (default {d.distill_steps})",
    )
    p.add_argument("--batch", type=int, default=d.batch, help=f"sequences per step (default {d.batch})")
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=d.prompt_tokens,
        help=f"prompt length drawn from --data (default {d.prompt_tokens})",
    )
    p.add_argument(
        "--gen-tokens", type=int, default=d.gen_tokens, help=f"generated tokens per sequence (default {d.gen_tokens})"
    )
    p.add_argument("--lr", type=float, default=d.lr, help=f"peak learning rate (default {d.lr:g})")
    p.add_argument(
        "--teacher-temperature", type=float, default=d.teacher_temperature, help="phase 1 sampling (0: greedy)"
    )
    p.add_argument(
        "--student-temperature", type=float, default=d.student_temperature, help="phase 2 sampling (0: greedy)"
    )
    p.add_argument(
        "--sft-targets",
        choices=["soft", "hard"],
        default=d.sft_targets,
        help="phase 1 targets: the teacher's token distributions (soft, default) or its sampled tokens (hard)",
    )
    p.add_argument(
        "--sft-text",
        choices=["teacher", "data"],
        default=d.sft_text,
        help="phase 1 text: continuations the teacher samples (default) or windows of --data, scored by the teacher",
    )
    p.add_argument(
        "--distill-top-k",
        type=int,
        default=d.distill_top_k,
        help="KL over the teacher's top-k tokens per position plus one bucket for the rest; "
        "0 (default): over the whole vocabulary",
    )
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="tokens of --data to use")
    p.add_argument(
        "--val-windows", type=int, default=d.val_windows, help="held-out windows for the before/after validation"
    )
    p.add_argument("--val-window", type=int, default=d.val_window, help="tokens per held-out window")
    p.add_argument(
        "--dequantize-resident",
        choices=["auto", "yes", "no"],
        default="auto",
        help="train on float copies of the resident int4 weights (same values; auto: on the CPU, where "
        "quantized matmuls are ~35x slower than float at training batch sizes)",
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--init",
        default=None,
        metavar="FILE",
        help="continue training this adapter (same base, K and pre-router; its targets, r and alpha are kept)",
    )
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from edge0.lora.adapter import save_adapter
    from edge0.lora.distill import Teacher
    from edge0.lora.train import TrainOptions, train

    teacher_dir = Path(args.teacher).expanduser()
    if not (teacher_dir / "config.json").is_file():
        raise Edge0Error(
            f"--teacher {teacher_dir}: no config.json there; pass the full-precision Hugging Face or mlx-lm "
            "checkpoint directory"
        )
    text = read_text(Path(args.data))
    # Exact executors read only the routed experts of each training window (kept until its
    # backward pass is done) and take a batch of sequences in one decode step.
    if args.init and not Path(args.init).is_file():
        raise Edge0Error(f"--init {args.init}: no such file; give an adapter written by edge0 train-lora")
    engine = edge0.load(
        args.model,
        dtype=args.dtype,
        top_k=args.top_k,
        prefill_executor="exact",
        decode_executor="exact",
        prerouter=False if args.no_prerouter else args.prerouter,
        lora=False,
    )
    print(engine.describe(), file=sys.stderr)
    teacher = Teacher(teacher_dir)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()] if args.targets else None
    opts = TrainOptions(
        r=args.r,
        alpha=args.alpha,
        targets=targets,
        sft_steps=args.sft_steps,
        distill_steps=args.distill_steps,
        batch=args.batch,
        prompt_tokens=args.prompt_tokens,
        gen_tokens=args.gen_tokens,
        lr=args.lr,
        teacher_temperature=args.teacher_temperature,
        student_temperature=args.student_temperature,
        distill_top_k=args.distill_top_k,
        sft_targets=args.sft_targets,
        sft_text=args.sft_text,
        max_tokens=args.max_tokens,
        val_window=args.val_window,
        val_windows=args.val_windows,
        seed=args.seed,
        init=args.init,
        dequantize_resident={"auto": None, "yes": True, "no": False}[args.dequantize_resident],
    )
    tensors, meta, report = train(engine, teacher, text, opts, data_name=str(args.data), teacher_name=str(teacher_dir))
    save_adapter(args.out, tensors, meta)
    b, a = report["before"], report["after"]
    print(
        f"held-out: teacher perplexity {report['teacher_perplexity']:.3f}; student {b['perplexity']:.3f} -> "
        f"{a['perplexity']:.3f}, "
        f"KL to teacher {b['kl_to_teacher']:.4f} -> {a['kl_to_teacher']:.4f} nats/token; distillation loss on a "
        "fixed probe "
        f"{report['probe_distill_loss_before']:.4f} -> {report['probe_distill_loss_after']:.4f}",
        file=sys.stderr,
    )
    print(f"wrote {args.out} (K={meta['top_k']}, r={meta['r']}, {len(meta['targets'])} linears)")
    return 0


if __name__ == "__main__":
    run_main(main)
