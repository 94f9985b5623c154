"""Exact token ids for routing: the router's ids must equal the engine's.

Three ways, chosen per model (`TokenizerSpec.mode`):
- "local": the model directory's tokenizer and chat template, applied as vLLM 0.33 applies them
  for /v1/chat/completions, /v1/completions and /v1/embeddings (text content); CPU work runs in
  a thread pool (the tokenizer releases the GIL), and a bounded prefix cache makes a multi-turn
  request tokenize only what is new since the previous turn.
- "render": ask a worker (vLLM's render endpoints, `/tokenize` as fallback).
- "request": ids the client sends.
In every mode, ids the engine itself will use (a completions prompt given as ids, vLLM's
`kv_transfer_params.prompt_token_ids`) are taken from the request and validated.

The router imports only the names below.
"""

from kvroute.router.tokenize.errors import TokenizeError
from kvroute.router.tokenize.service import Tokenizers
from kvroute.router.tokenize.spec import TokenizedPrompt, TokenizerSpec

__all__ = ["TokenizeError", "TokenizedPrompt", "TokenizerSpec", "Tokenizers"]
