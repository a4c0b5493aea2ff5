"""OpenAI's response shapes for the HTTP front: the usage block, finish reasons, and logprobs as the two
endpoints shape them."""

from __future__ import annotations

from serving.messages import Result


def usage_block(prompt: int, completion: int, migrations: int = 0, cached: int = 0) -> dict:
    """OpenAI's usage block, with prompt_tokens_details.cached_tokens (prompt tokens its worker's prefix
    cache held); a request that went on on another worker after its own died says how often (a sampled
    one's tokens after it are drawn afresh, not where its seed's stream had got to)."""
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    return {**usage, "migrations": migrations} if migrations else usage


class LogprobShapes:
    """Logprobs as OpenAI's two endpoints shape them, from the workers' (token id, logprob, rank) lists;
    each token's text and bytes decoded once per server."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.pieces: dict[int, tuple[str, list[int]]] = {}

    def piece(self, token: int) -> tuple[str, list[int]]:
        if token not in self.pieces:
            text = self.tokenizer.decode([token], skip_special_tokens=False)
            self.pieces[token] = (text, list(self.tokenizer.token_bytes(token)))
        return self.pieces[token]

    def chat(self, entries: list, k: int) -> dict:
        """{"content": [{token, logprob, bytes, top_logprobs: the k likeliest}]} (chat.completion)."""
        content = []
        for entry in entries:
            token, logprob, _ = entry[0]
            top = sorted((e for e in entry if e[2] <= k), key=lambda e: e[2])[:k]
            content.append(
                {**self._one(token, logprob), "top_logprobs": [self._one(t, lp) for t, lp, _ in top]}
            )
        return {"content": content}

    def _one(self, token: int, logprob: float) -> dict:
        text, raw = self.piece(token)
        return {"token": text, "logprob": logprob, "bytes": raw}

    def completion(self, entries: list, offset: int) -> tuple[dict, int]:
        """(text_completion's {tokens, token_logprobs, top_logprobs, text_offset}, the offset after them):
        top_logprobs holds the picked token and the k likeliest (up to k + 1, as OpenAI's)."""
        block = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for entry in entries:
            text = self.piece(entry[0][0])[0]
            block["tokens"].append(text)
            block["token_logprobs"].append(entry[0][1])
            block["top_logprobs"].append({self.piece(t)[0]: lp for t, lp, _ in entry})
            block["text_offset"].append(offset)
            offset += len(text)
        return block, offset


def finish_reason_of(result: Result) -> str:
    return "length" if result.finish_reason == "length" else "stop"
