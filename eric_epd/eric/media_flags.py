"""`eric-epd serve`'s media limit flags (video sampling and the bounds on video and audio decoding), parsed into
the MediaLimits of its EricConfig."""

from __future__ import annotations

import argparse

from eric_epd.media.limits import MediaLimits


def add_media_flags(p: argparse.ArgumentParser) -> None:
    """The video sampling and the video and audio decoding bounds, each defaulting to MediaLimits'."""
    p.add_argument(
        "--video-fps",
        type=float,
        default=MediaLimits.video_fps,
        help="frames sampled per second of video (models whose processor samples otherwise ignore it)",
    )
    p.add_argument(
        "--max-video-frames",
        type=int,
        default=MediaLimits.max_video_frames,
        help="most frames sampled from one video (a model sampling more is refused with 413)",
    )
    p.add_argument(
        "--max-video-source-frames",
        type=int,
        default=MediaLimits.max_video_source_frames,
        help="most frames a video may hold, read from its container before decoding (413 otherwise)",
    )
    p.add_argument(
        "--max-video-seconds",
        type=float,
        default=MediaLimits.max_video_seconds,
        help="longest video accepted, read from its container before decoding (413 otherwise)",
    )
    p.add_argument(
        "--max-video-decode-seconds",
        type=float,
        default=MediaLimits.max_video_decode_s,
        help="wall time one request's videos may take to decode before they are refused with 413",
    )
    p.add_argument(
        "--max-video-fps",
        type=float,
        default=MediaLimits.max_video_fps,
        help="highest frame rate a video may declare, read from its container before decoding (413)",
    )
    p.add_argument(
        "--max-video-decode-pixels",
        type=int,
        default=MediaLimits.max_video_decode_pixels,
        help="most pixels one request's videos may decode (each: its frames up to the last sampled one x "
        "its frame size, read from the container before decoding; 413 beyond)",
    )
    p.add_argument(
        "--max-audio-seconds",
        type=float,
        default=MediaLimits.max_audio_seconds,
        help="longest audio item accepted, from its header and again as decoded (413 otherwise)",
    )
    p.add_argument(
        "--max-audio-sample-rate",
        type=int,
        default=MediaLimits.max_audio_sample_rate,
        help="highest audio sample rate (Hz) accepted, read from the header before decoding (413 "
        "otherwise); at most the default, the highest rate the resampler takes",
    )
    p.add_argument(
        "--max-audio-channels",
        type=int,
        default=MediaLimits.max_audio_channels,
        help="most audio channels accepted, read from the header before decoding (413 otherwise)",
    )
    p.add_argument(
        "--max-audio-decode-bytes",
        type=int,
        default=MediaLimits.max_audio_decode_bytes,
        help="most bytes one audio item may decode to, as float32 samples of every channel (413 otherwise)",
    )


def media_limits(args: argparse.Namespace) -> MediaLimits:
    """The MediaLimits the flags of add_media_flags give (the fetch and image bounds keep their defaults)."""
    return MediaLimits(
        video_fps=args.video_fps,
        max_video_frames=args.max_video_frames,
        max_video_source_frames=args.max_video_source_frames,
        max_video_seconds=args.max_video_seconds,
        max_video_decode_s=args.max_video_decode_seconds,
        max_video_fps=args.max_video_fps,
        max_video_decode_pixels=args.max_video_decode_pixels,
        max_audio_seconds=args.max_audio_seconds,
        max_audio_sample_rate=args.max_audio_sample_rate,
        max_audio_channels=args.max_audio_channels,
        max_audio_decode_bytes=args.max_audio_decode_bytes,
    )
