"""The torch versions that fasthooks._C serves. Imports nothing, so that setup.py reads it too."""

# fasthooks._C uses torch's stable ABI only, which torch provides from this version on.
MIN_TORCH = (2, 10)
MIN_TORCH_TEXT = ".".join(map(str, MIN_TORCH))


def torch_version(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string.

    Examples:
        >>> torch_version("2.9.1+cu128")
        (2, 9)
    """
    major, minor = version.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
