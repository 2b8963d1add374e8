"""Scripted shoppers: an expert that acts on what it observes, and a noisy one.

``ShoppingExpert`` reads the request from the first observation, searches for the product noun,
keeps the listed items whose price and rating fit, opens them one by one, goes back from any
item that lacks the colour or the size or whose surcharge breaks the limit (a recovery from a
mistake), and on a fitting item selects colour and size and buys. It knows nothing hidden.
``noise_rate`` is the probability, before each of its actions, of one recoverable mistake:
opening an item that fails the listing filter (then going back), or a malformed call.
"""

from __future__ import annotations

import re

from closedloop.contracts import Action
from closedloop.envs.sim.experts import ObservingExpert

_REQUEST_RE = re.compile(r"Buy an? (\w+) (.+?) in size (\S+) for at most \$(\d+) \(size "
                         r"surcharge included\), rated at least ([\d.]+) stars\.")
_LISTED_RE = re.compile(r"(item_\d+) (.+?) \$(\d+) \(([\d.]+) stars\)")
_PAGE_RE = re.compile(r"^(item_\d+): .*?Price \$(\d+)\. Rating ([\d.]+) stars\. Colours: (.+?)\. "
                      r"Sizes: (.+?)\. Select")
_SIZE_RE = re.compile(r"^(\S+)(?: \(\+\$(\d+)\))?$")


class ShoppingExpert(ObservingExpert):
    """Plays one episode from observations (see the module docstring)."""

    def __init__(self, seed: int = 0, noise_rate: float = 0.0) -> None:
        super().__init__("shopping-expert", seed, noise_rate)
        self._want: tuple[str, str, str, int, float] | None = None
        self._queue: list[str] = []
        self._rejects: list[str] = []
        self._pending: list[Action] = []
        self._searched = False

    def _observe(self, observation: str) -> Action | str | None:
        """Read the request from the first observation (``abstain`` if there is none)."""
        if self._want is None:
            m = _REQUEST_RE.search(observation)
            if m is None:
                return Action.abstain()
            self._want = (m[1], m[2], m[3], int(m[4]), float(m[5]))
        return None

    def _plan(self, observation: str) -> Action:
        return Action.abstain() if self._want is None else self._next(observation, *self._want)

    def _next(self, observation: str, colour: str, noun: str, size: str, limit: int,
              rating: float) -> Action:
        if self._pending:
            return self._pending.pop(0)
        if not self._searched:
            self._searched = True
            return Action.tool("search", query=noun)
        if observation.startswith("Results for"):
            for item_id, title, price, stars in _LISTED_RE.findall(observation):
                fits = title.endswith(noun) and int(price) <= limit and float(stars) >= rating
                (self._queue if fits else self._rejects).append(item_id)
        page = _PAGE_RE.search(observation)
        if page is not None:
            sizes = dict(_size(s) for s in page[5].split(", "))
            if colour in page[4].split(", ") and size in sizes and float(page[3]) >= rating \
                    and int(page[2]) + sizes[size] <= limit:
                self._pending = [Action.tool("select", option="size", value=size),
                                 Action.tool("buy")]
                return Action.tool("select", option="color", value=colour)
            return Action.tool("back")
        if self._queue:
            return Action.tool("open_item", item_id=self._queue.pop(0))
        return Action.abstain()

    def _mistake(self, planned: Action) -> Action | str:
        if planned.name == "open_item" and self._rejects:
            self._queue.insert(0, str(planned.args["item_id"]))
            return Action.tool("open_item", item_id=self._rejects.pop(0))
        self._pending.insert(0, planned)
        return planned.canonical_text()[:-5]  # an unclosed call


def _size(text: str) -> tuple[str, int]:
    m = _SIZE_RE.match(text)
    return (text, 0) if m is None else (m[1], int(m[2] or 0))
