"""Attention modules and model classes that conversions need when no native transformers
architecture can express the result. Importing this package registers them with transformers'
Auto classes (`AutoConfig.register` / `AutoModelForCausalLM.register`)."""
