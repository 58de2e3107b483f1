"""transformers' side: the compressed layouts in transformers' quantizer registry
(``quantizer``; ``import whisper_modifiers`` registers it)."""
