"""Built-in fine-tuning recipes (YAML), listed by `effattn recipes ls` and read by `effattn.finetune.recipes`."""
