"""Model quality: each model's zero-shot accuracy on the four tasks of Chuppala (2024), measured
by lm-eval through the server's /v1/completions (`python -m serving.quality`).

- `tasks`: lm-eval's built-in hellaswag, copa, piqa and openbookqa, reading local files.
- `evaluate`: lm-eval's `local-completions` pinned to one model of a server, or lm-eval's own
  `vllm` backend on the model's files (the reference).
- `table`: the quality table file and the comparison with the thesis's Table 1.
- `data/`: small hand-written fixtures in each dataset's format, the default data.
"""
