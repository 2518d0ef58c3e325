"""What a prompt may carry besides text: images (``multimodal_prompts.py``, ``image_processing.py``)."""

from tensorrt_llm.inputs.image_processing import load_image
from tensorrt_llm.inputs.multimodal_prompts import IMAGE_TOKEN, MultimodalPrompts

__all__ = ["IMAGE_TOKEN", "MultimodalPrompts", "load_image"]
