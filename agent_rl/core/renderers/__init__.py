"""Chat formats, one module per model family, each rendering a conversation to token ids and parsing sampled ids
back (`base.Renderer`); `choose` picks a model's family; `toolcalls` and `bytelevel` are what families share."""
