"""transformers' side: the compressed layouts in transformers' quantizer registry
(``quantizer``; ``import whisper_sparse`` registers it)."""
