"""Images in requests, as the three APIs send them: Chat Completions `image_url` parts and Responses
`input_image` parts (data URLs), Anthropic `image` blocks (base64 sources). Each becomes an image
part of its message's content (`{"type": "image"}`, what the VL families' chat templates render as
their image placeholder), and its bytes travel beside the messages in the order the template meets
them (take_images). Links are fetched only with --fetch-image-urls; else a client sends the image
itself."""

from __future__ import annotations

import base64
import binascii

from edge0.server.errors import APIError

# The media types the image decoder reads (PIL): what the three APIs document.
MEDIA_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")
MAX_IMAGE_BYTES = 20 << 20  # per image, decoded (Anthropic's API takes at most 5 MB, OpenAI's 20 MB)
MAX_IMAGES = 16  # per request
FETCH_TIMEOUT_S = 10.0  # a link's whole image (--fetch-image-urls)
_DATA = "_edge0_image"  # the part's bytes and request field, until take_images moves them out


def data_url_part(url: str, param: str) -> dict:
    """The image part of a data URL (`data:image/png;base64,...`) or a link, read by take_images."""
    if url.startswith(("http://", "https://")):
        return link_part(url, param)
    return {"type": "image", _DATA: (lambda fetch: _data_url(url, param), param)}


def link_part(url: str, param: str) -> dict:
    """The image part of an http(s) link: fetched by take_images when the server allows it, else a 400."""
    return {"type": "image", _DATA: (lambda fetch: _fetched(url, param) if fetch else _link_refused(param), param)}


def base64_part(media_type: str | None, data: str | None, param: str) -> dict:
    """The image part of base64 `data` of `media_type`, read by take_images."""
    return {"type": "image", _DATA: (lambda fetch: _base64(media_type, data, param), param)}


def refused_part(error: APIError, param: str) -> dict:
    """An image part the server cannot read (a link, a file id): `error` when take_images reads it."""

    def fail(fetch):
        raise error

    return {"type": "image", _DATA: (fail, param)}


def _link_refused(param: str):
    raise APIError(
        400,
        f"{param}: image links are not fetched by this server (edge0 serve --fetch-image-urls allows it); send "
        "the image itself as a data URL (data:image/png;base64,...)",
        param,
        "image_url_unsupported",
    )


def _fetched(url: str, param: str) -> bytes:
    """The bytes of an image link (--fetch-image-urls): an image media type, at most MAX_IMAGE_BYTES,
    within FETCH_TIMEOUT_S; else a 400 naming `param` and what went wrong."""
    import httpx

    def refused(why: str):
        return APIError(400, f"{param}: {url} could not be used: {why}", param, "invalid_image")

    try:
        with httpx.stream("GET", url, timeout=FETCH_TIMEOUT_S, follow_redirects=True) as r:
            if r.status_code != 200:
                raise refused(f"HTTP {r.status_code}")
            kind = r.headers.get("content-type", "").split(";")[0].strip().lower()
            if kind not in MEDIA_TYPES:
                raise refused(f"its media type is {kind or 'not given'}, not one of {', '.join(MEDIA_TYPES)}")
            data = bytearray()
            for chunk in r.iter_bytes():
                data += chunk
                if len(data) > MAX_IMAGE_BYTES:
                    raise refused(f"it is over {MAX_IMAGE_BYTES >> 20} MB")
            return bytes(data)
    except httpx.HTTPError as e:
        raise refused(f"{type(e).__name__}") from None


def _data_url(url: str, param: str) -> bytes:
    """The bytes of a data URL; anything else is a 400 naming `param`."""
    head, sep, data = url.partition(",")
    if not (url.startswith("data:") and sep and head.endswith(";base64")):
        raise APIError(400, f"{param}: not a base64 data URL (data:image/png;base64,...)", param, "invalid_image")
    return _base64(head[len("data:") : -len(";base64")], data, param)


def _base64(media_type: str | None, data: str | None, param: str) -> bytes:
    """The bytes of base64 `data` of `media_type`; a 400 naming `param` when either is wrong."""
    if media_type not in MEDIA_TYPES:
        raise APIError(
            400,
            f"{param}: media type {media_type!r} is not an image this server reads; "
            f"send one of {', '.join(MEDIA_TYPES)}",
            param,
            "invalid_image",
        )
    if not data:
        raise APIError(400, f"{param}: the image has no data", param, "invalid_image")
    if len(data) > (MAX_IMAGE_BYTES * 4) // 3 + 4:
        raise APIError(
            400,
            f"{param}: the image is over {MAX_IMAGE_BYTES >> 20} MB; send a smaller one",
            param,
            "image_too_large",
        )
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, f"{param}: the image data is not valid base64", param, "invalid_image") from None


def url_refused(param: str, kind: str) -> dict:
    """The part of an image given by an uploaded file's id: a 400 when read."""
    return refused_part(
        APIError(
            400,
            f"{param}: images given by {kind} are not fetched by this server; send the image itself (base64 data)",
            param,
            "image_url_unsupported",
        ),
        param,
    )


def content(parts: list[dict]) -> str | list[dict]:
    """A message's content: its text when it has no image, else its text and image parts in order
    (adjacent texts joined)."""
    if not any(p["type"] == "image" for p in parts):
        return "".join(p["text"] for p in parts)
    out: list[dict] = []
    for p in parts:
        if p["type"] == "text" and out and out[-1]["type"] == "text":
            out[-1] = {"type": "text", "text": out[-1]["text"] + p["text"]}
        elif p["type"] != "text" or p["text"]:
            out.append(p)
    return out


def take_images(messages: list[dict] | None, fetch: bool = False) -> tuple[list[bytes], list[str]]:
    """The images of `messages` in the order the chat template meets them (message by message, part
    by part), read (a 400 naming the field of one that cannot be; links fetched when `fetch`), each
    part left as `{"type": "image"}`; and each one's request field. More than MAX_IMAGES is a 400.
    Blocking (a fetch): the server runs it in a worker thread."""
    data, params = [], []
    for m in messages or ():
        for part in m.get("content") if isinstance(m.get("content"), list) else ():
            if _DATA in part:
                read, param = part.pop(_DATA)
                data.append(read)
                params.append(param)
    if len(data) > MAX_IMAGES:
        raise APIError(
            400,
            f"{len(data)} images is above this server's limit of {MAX_IMAGES} per request",
            params[MAX_IMAGES],
            "too_many_images",
        )
    return [read(fetch) for read in data], params
