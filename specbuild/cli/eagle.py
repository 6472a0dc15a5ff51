"""`specbuild train-eagle` and `specbuild export-eagle`."""

from __future__ import annotations

import json

import click

from specbuild.cli.main import user_errors
from specbuild.cli.options import shared


@click.command("train-eagle")
@click.argument("bundle", type=click.Path())
@shared("--data", help="Spec-Bench-style jsonl [default: the packaged Spec-Bench; its train split only].")
@shared("--out", help="Directory for the head (and caches).")
@shared("--draft-vocab", help_extra=" (d2t/t2d)", help="Output tokens: the N most frequent target tokens of the training text")
@click.option("--ttt-steps", default=3, show_default=True, type=int,
              help="Training-time test: steps the head is unrolled on its own outputs.")
@shared("--max-prompts", default=160, help="Training prompts answered.")
@shared("--eval-prompts", help="Train-split prompts held out for the acceptance report.")
@shared("--max-answer-tokens", default=192)
@shared("--max-prompt-tokens")
@click.option("--sampled", is_flag=True, help="Also one sampled answer (T = 0.8) per prompt.")
@shared("--epochs")
@shared("--steps", help="Optimizer steps (one sequence window each) [epochs].")
@shared("--lr", default=1e-3)
@shared("--train-minutes")
@shared("--checkpoint-minutes")
@shared("--seed")
@shared("--threads")
@shared("--device", help="Where the target computes the features and the head trains: cpu, cuda, cuda:N.")
@shared("--resume", help="Reuse the answers, features and checkpoint in --out.")
@click.option("--corpus", default=None, type=click.Path(file_okay=False),
              help="Train on a corpus built by scripts/build_eagle_corpus.py (its answers and fixed held-out set) "
                   "instead of answering --data here.")
@click.option("--max-positions", default=None, type=int,
              help="Train on a seeded subset of at most this many positions (scale curves).")
@click.option("--shard-positions", default=16384, show_default=True, type=int,
              help="Positions per feature shard on disk (training holds one shard in memory).")
@click.option("--features-dir", default=None, type=click.Path(file_okay=False),
              help="Feature shards here instead of DIR/features, reused by every run over the same sequences.")
@click.option("--stop-at-step", default=None, type=int, help="Stop (checkpointed) at this step; --resume continues.")
@click.option("--ship", default=None, type=click.Path(file_okay=False),
              help="A head directory (e.g. the shipped one): the new head replaces it only if its held-out "
                   "acceptance beats that head's on the same chains.")
@click.option("--init", "init_head", default=None, type=click.Path(file_okay=False),
              help="Start from this head's weights and draft vocabulary (e.g. the shipped head, to adapt it to "
                   "another format's features) instead of a fresh initialisation.")
@shared("--no-progress")
@user_errors
def train_eagle_cmd(bundle, data_path, out_dir, draft_vocab, ttt_steps, max_prompts, eval_prompts, max_answer_tokens,
                    max_prompt_tokens, sampled, epochs, steps, lr, train_minutes, checkpoint_minutes, seed, threads,
                    device, resume, corpus, max_positions, shard_positions, features_dir, stop_at_step, ship, init_head, no_progress) -> None:
    """Train an EAGLE-3 head for BUNDLE's target by self-distillation (EAGLE-3 layout out)."""
    import torch

    from specbuild.train.eagle import EagleTrainConfig, train_eagle

    if threads:
        torch.set_num_threads(threads)
    cfg = EagleTrainConfig(draft_vocab=draft_vocab, ttt_steps=ttt_steps, max_prompts=max_prompts,
                           eval_prompts=eval_prompts, max_answer_tokens=max_answer_tokens,
                           max_prompt_tokens=max_prompt_tokens, sampled=sampled, epochs=epochs, steps=steps, lr=lr,
                           train_minutes=train_minutes, checkpoint_minutes=checkpoint_minutes, seed=seed,
                           max_positions=max_positions, shard_positions=shard_positions, stop_step=stop_at_step)
    report = train_eagle(bundle, data_path, out_dir, cfg, resume=resume, progress=not no_progress,
                         log=lambda m: click.echo(m, err=True), corpus=corpus, ship=ship, features_dir=features_dir,
                         init=init_head, device=device)
    click.echo(json.dumps({k: report[k] for k in ("steps", "train_rows", "train_seconds", "eval_before", "eval_after",
                                                  "epochs", "ship") if k in report}, indent=2))


@click.command("export-eagle")
@click.argument("bundle", type=click.Path())
@shared("--out")
@user_errors
def export_eagle_cmd(bundle, out_dir) -> None:
    """Write BUNDLE's EAGLE head in the EAGLE-3 layout (vLLM, SGLang, TensorRT-LLM PyTorch)."""
    from specbuild.compiler.eagle_role import export_eagle

    files = export_eagle(bundle, out_dir)
    click.echo(f"wrote {', '.join(files)} to {out_dir}")
