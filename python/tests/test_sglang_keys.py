"""kvxfer.sglang's store keys of SGLang's page hashes (no SGLang needed): each page hash
names its own entry, whatever string SGLang hands the backend."""

from kvxfer.sglang import page_key


def test_a_hex_page_hash_and_a_string_of_its_bytes_are_two_keys():
    assert page_key("41" * 32) != page_key("A" * 32)


def test_hex_digits_of_either_case_are_two_keys():
    assert page_key("ab" * 32) != page_key("AB" * 32)


def test_a_hex_page_hash_with_spaces_is_not_its_bytes():
    spaced = "41" * 31 + "  "
    assert len(spaced) == 64 and page_key(spaced) != page_key("A" * 31)


def test_sglangs_hex_page_hashes_are_short_store_keys():
    assert page_key("0123456789abcdef" * 4) == b"h" + bytes.fromhex("0123456789abcdef" * 4)
