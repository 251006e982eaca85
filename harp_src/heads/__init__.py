"""Attention heads one by one: gates and Taylor scores, attention-pattern statistics, LRP relevance, which heads to
remove, real removal, and LoRA recovery fine-tuning."""
