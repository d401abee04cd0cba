"""The longweave model: native-resolution vision tower + hybrid KDA / gated-MLA MoE decoder with block attention
residuals. Build with ``LongweaveModel(preset("tiny"))``; count with ``trainer.model.flops``."""
from trainer.model.batch import flatten_cu_seqlens, text_labels
from trainer.model.config import (AttnResConfig, KDAConfig, MLAConfig, ModelConfig, MoEConfig, VisionEncoderConfig,
                                  preset, small, tiny)
from trainer.model.multimodal import IGNORE_INDEX, LongweaveModel, ModelOutput

__all__ = [
    "AttnResConfig", "KDAConfig", "MLAConfig", "ModelConfig", "MoEConfig", "VisionEncoderConfig",
    "preset", "small", "tiny", "IGNORE_INDEX", "LongweaveModel", "ModelOutput",
    "flatten_cu_seqlens", "text_labels",
]
