"""openai-embedding: the inferlet behind ``POST /v1/embeddings``.

Args:
    inputs (list of list of int): the token ids of each input (the server
        tokenizes text inputs, BOS first where the model wants one, and
        checks every length against the model's context).
    pooling ("mean" | "last"): the model's ``[[models]] embedding_pooling``.
    model (str): the served model; adapter (str, optional): a LoRA adapter
        every pass runs with.

Every input is a context of its own and all their passes are submitted
together (:func:`tartlet.embedding.embed_many`), so the engine runs them as
one batch; each context is closed, its pages freed, once its vector is read.

Returns ``{"embeddings": [[float, ...], ...]}``: L2-normalised final hidden
states, pooled, in input order.
"""

from tartlet import Model, embedding


async def main(args: dict) -> dict:
    model = Model.load(args.get("model"))
    vectors = await embedding.embed_many(model, args["inputs"], pooling=args.get("pooling", "mean"), normalize=True,
                                         adapter=args.get("adapter"))
    return {"embeddings": vectors}
