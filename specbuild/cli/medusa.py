"""`specbuild train-medusa` and `specbuild export-medusa`."""

from __future__ import annotations

import json

import click

from specbuild.cli.main import user_errors


@click.command("train-medusa")
@click.argument("bundle", type=click.Path())
@click.option("--data", "data_path", default=None, type=click.Path(),
              help="Spec-Bench-style jsonl ({\"turns\": [...]} or {\"prompt\": ...}) [default: the packaged "
                   "Spec-Bench]. Its train split is used when the package's split covers its question ids "
                   "(eval split for the accuracy report), else a seeded 90/10 split.")
@click.option("--out", "out_dir", required=True, type=click.Path(), help="Directory for the heads (and caches).")
@click.option("--heads", "num_heads", default=4, show_default=True, type=int, help="Medusa heads (tree depth limit).")
@click.option("--layers", "num_layers", default=1, show_default=True, type=int, help="Residual blocks per head.")
@click.option("--steps", default=None, type=int, help="Optimizer steps [default: --epochs over the positions].")
@click.option("--epochs", default=4.0, show_default=True, type=float, help="Passes over the training positions.")
@click.option("--batch-positions", default=128, show_default=True, type=int, help="Positions per step.")
@click.option("--lr", default=3e-3, show_default=True, type=float, help="AdamW peak learning rate.")
@click.option("--shared-lm-head/--own-lm-head", default=True, show_default=True,
              help="Heads use the target's lm_head (frozen, not stored) or train their own copies (slower, larger).")
@click.option("--soft-labels", is_flag=True, help="Match the target's distribution (KL) instead of its tokens.")
@click.option("--weight-decay", default=0.0, show_default=True, type=float, help="AdamW weight decay.")
@click.option("--extra-answers", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="More training sequences: jsonl of {\"id\", \"prompt_ids\", \"answer_ids\"} from this "
                   "target (e.g. train-draft's answers_sampled.jsonl); repeatable.")
@click.option("--max-prompts", default=128, show_default=True, type=int, help="Training prompts (seeded sample).")
@click.option("--eval-prompts", default=16, show_default=True, type=int, help="Eval prompts for the accuracy report.")
@click.option("--max-answer-tokens", default=128, show_default=True, type=int, help="Tokens per target answer.")
@click.option("--max-prompt-tokens", default=1024, show_default=True, type=int, help="Longer prompts are skipped.")
@click.option("--temperature", default=0.0, show_default=True, type=float, help="Target's sampling for the answers.")
@click.option("--train-minutes", default=None, type=float, help="Stop training after this long (then save).")
@click.option("--checkpoint-minutes", default=5.0, show_default=True, type=float, help="Checkpoint interval.")
@click.option("--bf16", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="The frozen lm_head matmul in bfloat16: auto = only if measured faster here.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--threads", default=None, type=int, help="Torch CPU threads.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda, cuda:N.")
@click.option("--resume", is_flag=True, help="Continue from the answers, hidden states and checkpoint in --out.")
@user_errors
def train_medusa_cmd(bundle, data_path, out_dir, num_heads, num_layers, steps, epochs, batch_positions, lr,
                     shared_lm_head, soft_labels, weight_decay, extra_answers, max_prompts, eval_prompts, max_answer_tokens, max_prompt_tokens,
                     temperature, train_minutes, checkpoint_minutes, bf16, seed, threads, device, resume) -> None:
    """Train Medusa heads for BUNDLE's target on its own answers (self-distillation)."""
    import torch

    from specbuild.train.medusa import MedusaTrainConfig, train_medusa

    if threads:
        torch.set_num_threads(threads)
    cfg = MedusaTrainConfig(num_heads=num_heads, num_layers=num_layers, steps=steps, epochs=epochs,
                            batch_positions=batch_positions, lr=lr, shared_lm_head=shared_lm_head,
                            soft_labels=soft_labels, weight_decay=weight_decay,
                            extra_answers=tuple(extra_answers), max_prompts=max_prompts, eval_prompts=eval_prompts,
                            max_answer_tokens=max_answer_tokens, max_prompt_tokens=max_prompt_tokens,
                            temperature=temperature, seed=seed, checkpoint_minutes=checkpoint_minutes,
                            train_minutes=train_minutes, bf16=bf16, device=device)
    report = train_medusa(bundle, data_path, out_dir, cfg, resume=resume, log=lambda m: click.echo(m, err=True))
    click.echo(f"heads written to {out_dir} in {report['seconds']['total']:.0f}s "
               f"(answers {report['seconds']['distill']:.0f}s, hidden {report['seconds']['hidden']:.0f}s, "
               f"training {report['seconds']['train']:.0f}s)", err=True)
    if report["accuracy_after"]:
        click.echo(f"eval accuracy ({report['eval_prompts']} prompts), head k guesses token k + 2 ahead:", err=True)
        for b, a in zip(report["accuracy_before"], report["accuracy_after"]):
            click.echo(f"  head {a['head']}: top-1 {a['top1']:.1%} (untrained {b['top1']:.1%}), "
                       f"top-5 {a['top5']:.1%} (untrained {b['top5']:.1%}) over {a['positions']} positions", err=True)
    click.echo(f"use it: specbuild compile --target ... --medusa {out_dir} --tree NAME", err=True)


@click.command("export-medusa")
@click.argument("bundle", type=click.Path())
@click.option("--format", "fmt", type=click.Choice(["fasterdecoding", "tensorrt-llm"]), default="fasterdecoding",
              show_default=True, help="Tensor names of the written heads.")
@click.option("--out", "out_dir", required=True, type=click.Path(), help="Directory to write.")
@user_errors
def export_medusa_cmd(bundle, fmt, out_dir) -> None:
    """Write BUNDLE's Medusa heads standalone, each with its own lm_head copy, for other tools."""
    from specbuild.compiler.medusa_role import export_medusa

    paths = export_medusa(bundle, fmt, out_dir)
    click.echo(json.dumps({"format": fmt, "files": paths}))
