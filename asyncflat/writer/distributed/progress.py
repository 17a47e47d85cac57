"""Progress of the tokenize pass: units and tokens done, tokens/s and an ETA, to logging and tqdm."""

from __future__ import annotations

import logging
import time

from tqdm.auto import tqdm

__all__ = ["Progress"]

log = logging.getLogger("asyncflat.writer.distributed")


class Progress:
    """Counts finished units; the ETA is from the input bytes still to tokenize."""

    def __init__(self, units: int, input_bytes: int, *, bar: bool, log_every_s: float = 30.0):
        self.units = units
        self.input_bytes = max(input_bytes, 1)
        self.done_units = 0
        self.done_bytes = 0
        self.resumed_units = 0
        self.tokens = 0
        self._new_bytes = 0
        self._new_tokens = 0
        self._t0 = time.perf_counter()
        self._last_log = self._t0
        self._log_every_s = log_every_s
        self._bar = tqdm(
            total=units, unit=" units", desc="tokenize", disable=not bar, dynamic_ncols=True
        )

    def resumed(self, tokens: int, input_bytes: int) -> None:
        self.resumed_units += 1
        self._add(tokens, input_bytes)

    def finished(self, tokens: int, input_bytes: int) -> None:
        self._new_bytes += input_bytes
        self._new_tokens += tokens
        self._add(tokens, input_bytes)

    @property
    def tokens_per_s(self) -> float:
        elapsed = time.perf_counter() - self._t0
        return self._new_tokens / elapsed if elapsed > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        if not self._new_bytes:
            return None
        rate = self._new_bytes / (time.perf_counter() - self._t0)
        return (self.input_bytes - self.done_bytes) / rate

    def _add(self, tokens: int, input_bytes: int) -> None:
        self.done_units += 1
        self.done_bytes += input_bytes
        self.tokens += tokens
        self._bar.update(1)
        eta = self.eta_s
        self._bar.set_postfix(
            tokens=f"{self.tokens:,}",
            tok_s=f"{self.tokens_per_s:,.0f}",
            eta=f"{eta:.0f}s" if eta is not None else "?",
            refresh=False,
        )
        now = time.perf_counter()
        if now - self._last_log >= self._log_every_s or self.done_units == self.units:
            self._last_log = now
            log.info(
                "tokenized %d/%d units (%d resumed), %d tokens, %.0f tokens/s, ETA %s",
                self.done_units,
                self.units,
                self.resumed_units,
                self.tokens,
                self.tokens_per_s,
                f"{eta:.0f} s" if eta is not None else "unknown",
            )

    def close(self) -> None:
        self._bar.close()
