"""lm-eval glue: gsm8k task specs (tasks), synthetic data (synthetic), runs against a server
(lm_eval_runner), plan comparison (compare) and its table/files (report). See NOTES.md for lm-eval facts."""
