"""The torch step loop: Engine, the scheduler, sequences and their typed speculation state, incremental text, chat templates."""
