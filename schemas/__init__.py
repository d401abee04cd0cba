"""The data contract shared by the pipeline, the loader, the trainer and the inspection tool."""
from schemas.document import DOCUMENT_SCHEMA, Document, Segment, documents_to_table, table_to_documents
from schemas.errors import SchemaError
from schemas.manifest import MANIFEST_NAME, DocumentCounts, ShardEntry, ShardManifest
from schemas.sample import (
    IMAGE_EXTENSIONS,
    LOSS_MASK_RULE,
    META_MEMBER,
    TOKENS_MEMBER,
    ImageSpan,
    PackedSampleMeta,
    PieceProvenance,
    image_member,
    validate_key,
)
from schemas.stage import DEFAULT_STAGES, STAGE_ORDER, LengthBucket, StageSpec, load_stage_config

__all__ = [
    "DOCUMENT_SCHEMA", "Document", "Segment", "documents_to_table", "table_to_documents", "SchemaError",
    "MANIFEST_NAME", "DocumentCounts", "ShardEntry", "ShardManifest", "IMAGE_EXTENSIONS", "LOSS_MASK_RULE",
    "META_MEMBER", "TOKENS_MEMBER", "ImageSpan", "PackedSampleMeta", "PieceProvenance", "image_member",
    "validate_key", "DEFAULT_STAGES", "STAGE_ORDER", "LengthBucket", "StageSpec", "load_stage_config",
]
