"""Refusing image content in prompts (SPEC §2.9, §14): training is text-only.

A vision-language checkpoint trains on text; a prompt whose messages carry images (content parts of type
``image``/``image_url``/``video``..., or an ``images`` field) would need the vision tower in the forward and 3-D
M-RoPE positions in packed rows, neither of which exists. Such a prompt is refused with the row and the fix rather
than trained as if its images were not there.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["ImagesUnsupported", "check_text_only", "image_part"]

_IMAGE_TYPES = {"image", "image_url", "input_image", "video", "video_url", "input_video"}
_IMAGE_KEYS = ("image", "image_url", "images", "video", "videos")


class ImagesUnsupported(ValueError):
    """A prompt contains image or video content, which training does not support (SPEC §14)."""


def image_part(messages: Any) -> str | None:
    """A short description of the first image/video content in ``messages`` (a list of chat messages), or ``None``.

    Strings and text parts (``{"type": "text", "text": ...}``) are text; anything else that names an image or video
    (by ``type`` or key) counts, as does a non-text object (e.g. a PIL image) inside a content list.
    """
    if not isinstance(messages, list):
        return None
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        for key in _IMAGE_KEYS:
            if message.get(key) is not None:
                return f"message {i} has an {key!r} field"
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, str):
                    continue
                if isinstance(part, dict):
                    kind = part.get("type")
                    if kind in _IMAGE_TYPES or any(part.get(k) is not None for k in _IMAGE_KEYS):
                        return f"message {i} content part {j} is of type {kind!r}"
                    continue
                return f"message {i} content part {j} is a {type(part).__name__}"
    return None


def check_text_only(prompts: Iterable[Any], where: str = "train_dataset") -> None:
    """Raise :class:`ImagesUnsupported` for the first prompt with image/video content.

    Args:
        prompts: chat-message lists (rows' ``prompt`` values).
        where: what the prompts are, for the message (e.g. ``"train_dataset"``).
    """
    for row, messages in enumerate(prompts):
        found = image_part(messages)
        if found is not None:
            raise ImagesUnsupported(
                f"{where} row {row}: the prompt contains image content ({found}). Images are not supported (SPEC "
                "§14): vision-language models train on text-only prompts, with the vision tower frozen. Fix: drop "
                "the image parts (or the rows that have them) from the dataset"
            )
