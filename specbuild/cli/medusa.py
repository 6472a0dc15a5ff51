"""`specbuild train-medusa` and `specbuild export-medusa`."""

from __future__ import annotations

import json

import click

from specbuild.cli.main import user_errors
from specbuild.cli.options import shared


@click.command("train-medusa")
@click.argument("bundle", type=click.Path())
@shared("--data", help_extra=" (The eval split feeds the accuracy report.)")
@shared("--out", help="Directory for the heads (and caches).")
@click.option("--heads", "num_heads", default=4, show_default=True, type=int, help="Medusa heads (tree depth limit).")
@click.option("--layers", "num_layers", default=1, show_default=True, type=int, help="Residual blocks per head.")
@shared("--steps")
@shared("--epochs")
@click.option("--batch-positions", default=128, show_default=True, type=int, help="Positions per step.")
@shared("--lr", default=3e-3)
@click.option("--shared-lm-head/--own-lm-head", default=True, show_default=True,
              help="Heads use the target's lm_head (frozen, not stored) or train their own copies (slower, larger).")
@click.option("--soft-labels", is_flag=True, help="Match the target's distribution (KL) instead of its tokens.")
@click.option("--weight-decay", default=0.0, show_default=True, type=float, help="AdamW weight decay.")
@click.option("--extra-answers", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="More training sequences: jsonl of {\"id\", \"prompt_ids\", \"answer_ids\"} from this "
                   "target (e.g. train-draft's answers_sampled.jsonl); repeatable.")
@shared("--max-prompts")
@shared("--eval-prompts", default=16, help="Eval prompts for the accuracy report.")
@shared("--max-answer-tokens")
@shared("--max-prompt-tokens", default=1024)
@shared("--temperature", default=0.0, show_default=True, help="Target's sampling for the answers.")
@shared("--train-minutes")
@shared("--checkpoint-minutes")
@click.option("--bf16", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="The frozen lm_head matmul in bfloat16: auto = only if measured faster here.")
@shared("--seed")
@shared("--threads")
@shared("--device")
@shared("--resume")
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
@shared("--out")
@user_errors
def export_medusa_cmd(bundle, fmt, out_dir) -> None:
    """Write BUNDLE's Medusa heads standalone, each with its own lm_head copy, for other tools."""
    from specbuild.compiler.medusa_role import export_medusa

    paths = export_medusa(bundle, fmt, out_dir)
    click.echo(json.dumps({"format": fmt, "files": paths}))
