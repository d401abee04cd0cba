"""Text tokenizer, special tokens and the token layout of interleaved documents."""
from tokenization.layout import TokenLayout, encode_document
from tokenization.special import SPECIAL_TOKENS
from tokenization.tokenizer import DEFAULT_TOKENIZER_PATH, SpecialIds, TextTokenizer, load_tokenizer

__all__ = ["TokenLayout", "encode_document", "SPECIAL_TOKENS", "DEFAULT_TOKENIZER_PATH", "SpecialIds",
           "TextTokenizer", "load_tokenizer"]
