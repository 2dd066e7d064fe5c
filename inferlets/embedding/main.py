"""embedding: one vector per input text, from the model's hidden states.

Each input runs in a context of its own; the forward passes of all inputs
are submitted together, so the engine batches their prefills, and each
context's pages are freed as soon as its vector is read. The vector is the
``mean`` of the final hidden states of every input token, or the ``last``
token's (:mod:`tartlet.embedding`), divided by its L2 norm unless
``normalize`` is false. The default model is a causal LM, not a trained
embedder: its vectors show the mechanism (similar texts are closer than
unrelated ones), not a retrieval-grade embedding.

Args:
    prompt (str, required): the text to embed (alias: ``text``), or a list
        of texts (token-id lists are taken as token ids), embedded in one batch.
    pooling ("mean" | "last", default "mean"): how token states become one vector.
    normalize (bool, default true): L2-normalise each vector.
    layer (int, optional): pool that decoder layer's outputs (0-based,
        negative from the end) instead of the final hidden states.
    model (str, optional): the served model.

Returns ``{"embeddings": [[float, ...], ...], "dimensions": int, "tokens":
[int, ...] (tokens of each input), "pooling": str, "normalized": bool}``.
"""

from tartlet import Model, embedding


async def main(args: dict) -> dict:
    texts = args.get("prompt", args.get("text"))
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, list) or not texts or not all(isinstance(t, (str, list)) and t for t in texts):
        raise ValueError("embedding needs `prompt`: a non-empty string or a non-empty list of non-empty strings")
    pooling = embedding.check_pooling(args.get("pooling", "mean"))
    normalize = args.get("normalize", True)
    if not isinstance(normalize, bool):
        raise ValueError(f"embedding: `normalize` must be true or false, got {normalize!r}")
    layer = args.get("layer")
    model = Model.load(args.get("model"))
    tokens = [len(embedding.input_tokens(model, t)) for t in texts]
    vectors = await embedding.embed_many(model, texts, pooling=pooling, normalize=normalize, layer=layer)
    return {"embeddings": vectors, "dimensions": len(vectors[0]), "tokens": tokens, "pooling": pooling,
            "normalized": normalize}
