"""KV pages on the host: allocation, reference counts and the prefix cache. Plain Python, no JAX.

A full page of prompt tokens is named by a hash chained over every token before it, so two requests with the same
prefix share the page. A cached page whose last user leaves stays cached (least recently freed evicted first) until
an allocation needs it.
"""

import collections
import hashlib
from collections.abc import Callable


def page_hashes(token_ids: list[int], page_size: int, num_pages: int) -> list[bytes]:
    """Chained hashes of the first num_pages full pages of token_ids."""
    hashes, previous = [], b""
    for page in range(num_pages):
        chunk = token_ids[page * page_size:(page + 1) * page_size]
        previous = hashlib.blake2b(previous + repr(chunk).encode(), digest_size=16).digest()
        hashes.append(previous)
    return hashes


class PageManager:
    def __init__(self, num_pages: int, page_size: int):
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = collections.deque(range(num_pages))
        self._ref_counts = [0] * num_pages
        self._page_of_hash: dict[bytes, int] = {}
        self._hash_of_page: dict[int, bytes] = {}
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, unused
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_free_pages(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self.num_free_pages

    def allocate(self, count: int) -> list[int] | None:
        """count fresh pages, or None (and nothing taken) when too few are free."""
        if count > self.num_free_pages:
            return None
        pages = []
        for _ in range(count):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._evictable.popitem(last=False)
                del self._page_of_hash[self._hash_of_page.pop(page)]
            self._ref_counts[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: list[int]) -> None:
        # last page first: eviction takes the oldest, so a prompt loses its tail before its head, and a repeat still
        # matches the pages before the first evicted one (a lookup stops there)
        for page in reversed(pages):
            self._ref_counts[page] -= 1
            if self._ref_counts[page] > 0:
                continue
            if page in self._hash_of_page:
                self._evictable[page] = None
            else:
                self._free.append(page)

    def match_prefix(self, hashes: list[bytes], count: bool = True, new_query: bool = True,
                     usable_run: Callable[[int], int] | None = None) -> list[int]:
        """Take a reference on the longest run of cached pages for these hashes, or on the first usable_run(length)
        of them. count: in the hit rate (not a preempted request's recompute finding its own pages again); new_query:
        False for hashes an earlier call already counted as looked up (only the hits count)."""
        pages = []
        for page_hash in hashes:
            page = self._page_of_hash.get(page_hash)
            if page is None:
                break
            pages.append(page)
        if usable_run is not None:
            pages = pages[:usable_run(len(pages))]
        for page in pages:
            if self._ref_counts[page] == 0:
                del self._evictable[page]
            self._ref_counts[page] += 1
        if count:
            self.prefix_queries += len(hashes) if new_query else 0
            self.prefix_hits += len(pages)
        return pages

    def register(self, page: int, page_hash: bytes) -> None:
        """Offer a fully written prompt page to later requests."""
        if page_hash in self._page_of_hash or page in self._hash_of_page:
            return
        self._page_of_hash[page_hash] = page
        self._hash_of_page[page] = page_hash

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
