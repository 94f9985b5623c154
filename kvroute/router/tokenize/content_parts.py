"""The chat content-part types vLLM 0.33 knows, in one place for every parser of the router.

vLLM parses a content part by its `type` (its renderer's parser map): text-like parts are
rendered into the prompt, `tool_reference` parts go to the chat template as they are, and
the multimodal ones carry data the router cannot turn into token ids. A part of any other
type is refused by vLLM ("Unsupported chat content part type"), so the router refuses it too
instead of treating it as multimodal. A part without a `type` (or with a `uuid`) is
multimodal when it holds one of the multimodal keys.
"""

from __future__ import annotations

# text-like part type -> the field holding its text
TEXT_FIELDS: dict[str, str] = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
TOOL_REFERENCE = "tool_reference"
# Part types that carry no multimodal data.
TEXT_CONTENT_PART_TYPES = frozenset(TEXT_FIELDS) | {TOOL_REFERENCE}
# Part types, and keys of untyped parts, that carry multimodal data.
MEDIA_PART_TYPES = frozenset(
    {
        "image_url",
        "input_image",
        "image_embeds",
        "image_pil",
        "audio_url",
        "input_audio",
        "audio_embeds",
        "video_url",
        "video_embeds",
        "prompt_embeds",
    }
)
