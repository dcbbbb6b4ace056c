"""The trained heads' default recipe, shared by `train_medusa` / `train_eagle` and their `brisk spec` commands
(kept free of torch so the CLI can show it without importing it). BENCHMARKS gives what it costs and measures."""

# self-distillation data: the target's greedy answers to chat prompts cut from the text + prompts it writes itself
DATA_PROMPTS = 5000
DATA_WRITTEN = 5000
DATA_MAX_TOKENS = 160

MEDUSA_HEADS = 4
MEDUSA_STEPS = 8000
MEDUSA_BATCH = 128  # hidden-state rows per step
MEDUSA_LR = 2e-3

EAGLE_STEPS = 32000
EAGLE_BATCH = 8  # windows per step
EAGLE_WINDOW = 32  # consecutive rows per window
EAGLE_LR = 1e-3

DRAFT_VOCAB = 8192  # the most frequent target tokens the heads draft from
