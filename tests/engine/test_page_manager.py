"""Page allocation, reference counts and the prefix cache, on the host alone."""

from jaxllm.engine.page_manager import PageManager, page_hashes


def test_allocate_takes_nothing_when_too_few_pages_are_free():
    pages = PageManager(num_pages=4, page_size=2)
    assert pages.allocate(3) is not None
    assert pages.allocate(2) is None
    assert pages.num_free_pages == 1


def test_freed_pages_are_reused():
    pages = PageManager(num_pages=2, page_size=2)
    first = pages.allocate(2)
    pages.free(first)
    assert sorted(pages.allocate(2)) == sorted(first)


def test_hashes_chain_over_the_whole_prefix():
    a = page_hashes([1, 2, 3, 4], page_size=2, num_pages=2)
    b = page_hashes([9, 9, 3, 4], page_size=2, num_pages=2)
    assert a[0] != b[0] and a[1] != b[1]  # same second page, different prefix
    assert page_hashes([1, 2, 3, 4, 5], 2, 2) == a


def test_a_registered_page_is_shared_and_survives_its_first_owner():
    pages = PageManager(num_pages=3, page_size=2)
    hashes = page_hashes([1, 2, 3, 4], 2, 2)
    owner = pages.allocate(2)
    for page, page_hash in zip(owner, hashes):
        pages.register(page, page_hash)
    pages.free(owner)
    assert pages.num_free_pages == 3  # cached pages count as free
    assert pages.match_prefix(hashes) == owner
    assert pages.num_free_pages == 1
    assert pages.prefix_hit_rate == 1.0


def test_match_stops_at_the_first_miss():
    pages = PageManager(num_pages=4, page_size=2)
    hashes = page_hashes([1, 2, 3, 4, 5, 6], 2, 3)
    owner = pages.allocate(1)
    pages.register(owner[0], hashes[0])
    assert pages.match_prefix(hashes) == owner
    assert (pages.prefix_hits, pages.prefix_queries) == (1, 3)


def test_a_match_cut_short_takes_and_counts_only_the_pages_it_keeps():
    pages = PageManager(num_pages=4, page_size=2)
    hashes = page_hashes([1, 2, 3, 4, 5, 6], 2, 3)
    owner = pages.allocate(3)
    for page, page_hash in zip(owner, hashes):
        pages.register(page, page_hash)
    pages.free(owner)
    assert pages.match_prefix(hashes, usable_run=lambda length: length // 2 * 2) == owner[:2]
    assert pages.num_free_pages == 2  # the third stays cached and unreferenced
    assert (pages.prefix_hits, pages.prefix_queries) == (2, 3)
    assert pages.match_prefix(hashes[:1], usable_run=lambda length: length // 2 * 2) == []


def test_cached_pages_are_evicted_least_recently_freed_first():
    pages = PageManager(num_pages=2, page_size=1)
    first, second = pages.allocate(2)
    hash_a, hash_b = page_hashes([7, 8], 1, 2)
    pages.register(first, hash_a)
    pages.register(second, hash_b)
    pages.free([first])
    pages.free([second])
    assert pages.allocate(1) == [first]
    assert pages.match_prefix([hash_a]) == []  # evicted
    assert pages.match_prefix([hash_a, hash_b]) == []  # the chain breaks at the first page


def test_a_freed_prompt_loses_its_tail_first_and_a_repeat_still_matches_its_head():
    pages = PageManager(num_pages=5, page_size=2)
    hashes = page_hashes(list(range(10)), 2, 5)
    owner = pages.allocate(5)
    for page, page_hash in zip(owner, hashes):
        pages.register(page, page_hash)
    pages.free(owner)
    assert sorted(pages.allocate(2)) == sorted(owner[3:])  # the last two pages go
    assert pages.match_prefix(hashes) == owner[:3]
