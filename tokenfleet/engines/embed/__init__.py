"""Embeddings: a sentence-transformers directory's encoder, pooling and normalisation, run as
prefill-only passes with no K/V kept."""
