"""The simulated model directory: a real (small) Hugging Face tokenizer and chat template.

Load it like any local model directory (`tokenizer.json`, `tokenizer_config.json` with a
`chat_template`). `python -m kvroute.sim.model.build` regenerates the files deterministically.
"""

from pathlib import Path

MODEL_DIR = Path(__file__).resolve().parent
"""Path of the model directory (pass it wherever a local model path is expected)."""
