"""`specbuild train-eagle` and `specbuild export-eagle`."""

from __future__ import annotations

import json

import click

from specbuild.cli.main import user_errors


@click.command("train-eagle")
@click.argument("bundle", type=click.Path())
@click.option("--data", "data_path", default=None, type=click.Path(),
              help="Spec-Bench-style jsonl [default: the packaged Spec-Bench; its train split only].")
@click.option("--out", "out_dir", required=True, type=click.Path(), help="Directory for the head (and caches).")
@click.option("--draft-vocab", default=8192, show_default=True, type=int,
              help="Output tokens: the N most frequent target tokens of the training text (d2t/t2d).")
@click.option("--ttt-steps", default=3, show_default=True, type=int,
              help="Training-time test: steps the head is unrolled on its own outputs.")
@click.option("--max-prompts", default=160, show_default=True, type=int, help="Training prompts answered.")
@click.option("--eval-prompts", default=12, show_default=True, type=int,
              help="Train-split prompts held out for the acceptance report.")
@click.option("--max-answer-tokens", default=192, show_default=True, type=int)
@click.option("--max-prompt-tokens", default=512, show_default=True, type=int)
@click.option("--sampled", is_flag=True, help="Also one sampled answer (T = 0.8) per prompt.")
@click.option("--epochs", default=4.0, show_default=True, type=float)
@click.option("--steps", default=None, type=int, help="Optimizer steps (one sequence window each) [epochs].")
@click.option("--lr", default=1e-3, show_default=True, type=float)
@click.option("--train-minutes", default=None, type=float, help="Stop training after this long (then save).")
@click.option("--checkpoint-minutes", default=5.0, show_default=True, type=float)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--threads", default=None, type=int)
@click.option("--resume", is_flag=True, help="Reuse the answers, features and checkpoint in --out.")
@click.option("--no-progress", is_flag=True)
@user_errors
def train_eagle_cmd(bundle, data_path, out_dir, draft_vocab, ttt_steps, max_prompts, eval_prompts, max_answer_tokens,
                    max_prompt_tokens, sampled, epochs, steps, lr, train_minutes, checkpoint_minutes, seed, threads,
                    resume, no_progress) -> None:
    """Train an EAGLE-3 head for BUNDLE's target by self-distillation (EAGLE-3 layout out)."""
    import torch

    from specbuild.train.eagle import EagleTrainConfig, train_eagle

    if threads:
        torch.set_num_threads(threads)
    cfg = EagleTrainConfig(draft_vocab=draft_vocab, ttt_steps=ttt_steps, max_prompts=max_prompts,
                           eval_prompts=eval_prompts, max_answer_tokens=max_answer_tokens,
                           max_prompt_tokens=max_prompt_tokens, sampled=sampled, epochs=epochs, steps=steps, lr=lr,
                           train_minutes=train_minutes, checkpoint_minutes=checkpoint_minutes, seed=seed)
    report = train_eagle(bundle, data_path, out_dir, cfg, resume=resume, progress=not no_progress,
                         log=lambda m: click.echo(m, err=True))
    click.echo(json.dumps({k: report[k] for k in ("steps", "train_seconds", "eval_before", "eval_after")}, indent=2))


@click.command("export-eagle")
@click.argument("bundle", type=click.Path())
@click.option("--out", "out_dir", required=True, type=click.Path())
@user_errors
def export_eagle_cmd(bundle, out_dir) -> None:
    """Write BUNDLE's EAGLE head in the EAGLE-3 layout (vLLM, SGLang, TensorRT-LLM PyTorch)."""
    from specbuild.compiler.eagle_role import export_eagle

    files = export_eagle(bundle, out_dir)
    click.echo(f"wrote {', '.join(files)} to {out_dir}")
