"""A small real MCP server: unit conversion, written with the official SDK's `MCPServer`.

Owns: the unit table (`UNITS`), `convert_value`, and the server with two tools, `convert` and
`list_units`, run over stdio or streamable HTTP:

    python examples/mcp_units_server.py                 # stdio (what an MCP client starts)
    python examples/mcp_units_server.py --http 8765     # streamable HTTP at http://127.0.0.1:8765/mcp

Does not own: the environment that asks questions about units (`envs.mcp_units`) or the client
(`tools.mcp`). The module imports the SDK only when it serves, so `envs.mcp_units` can read the
table to write its tasks without paying for the SDK import. It imports nothing from agent-rl: a
server runs as its own process, whatever is or is not installed around it. (It lives here, not in
tools/, because a script run from tools/ would import tools/mcp.py as the SDK's `mcp`.)
"""

from __future__ import annotations

import argparse
import logging
from decimal import Decimal

# unit -> (quantity, factor to the base unit); temperatures convert through kelvin below
UNITS: dict[str, tuple[str, float]] = {
    "m": ("length", 1.0), "km": ("length", 1000.0), "cm": ("length", 0.01), "mm": ("length", 0.001),
    "mi": ("length", 1609.344), "yd": ("length", 0.9144), "ft": ("length", 0.3048), "in": ("length", 0.0254),
    "kg": ("mass", 1.0), "g": ("mass", 0.001), "lb": ("mass", 0.45359237), "oz": ("mass", 0.028349523125),
    "l": ("volume", 1.0), "ml": ("volume", 0.001), "gal": ("volume", 3.785411784), "cup": ("volume", 0.2365882365),
    "C": ("temperature", 1.0), "F": ("temperature", 1.0), "K": ("temperature", 1.0),
}
_TO_KELVIN = {"C": lambda v: v + 273.15, "F": lambda v: (v - 32) * 5 / 9 + 273.15, "K": lambda v: v}
_FROM_KELVIN = {"C": lambda k: k - 273.15, "F": lambda k: (k - 273.15) * 9 / 5 + 32, "K": lambda k: k}


class UnitError(ValueError):
    """A conversion that cannot be done; the message says why in one line."""


def show(x: float) -> str:
    """6 significant digits written out in full, never in exponent form (0.0000528166, not 5.28166e-05):
    an answer a model copies must be a plain number."""
    text = format(Decimal(f"{x:.6g}"), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def convert_value(value: float, from_unit: str, to_unit: str) -> float:
    """`value` in `from_unit`, expressed in `to_unit`."""
    for unit in (from_unit, to_unit):
        if unit not in UNITS:
            raise UnitError(f"unknown unit {unit!r}; known units: {', '.join(UNITS)}")
    (kind, factor), (to_kind, to_factor) = UNITS[from_unit], UNITS[to_unit]
    if kind != to_kind:
        raise UnitError(f"cannot convert {kind} ({from_unit}) to {to_kind} ({to_unit})")
    if kind == "temperature":
        return _FROM_KELVIN[to_unit](_TO_KELVIN[from_unit](value))
    return value * factor / to_factor


def build_server():
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError

    server = MCPServer("units", log_level="WARNING")

    @server.tool()
    def convert(value: float, from_unit: str, to_unit: str) -> str:
        """Convert a quantity between units of length, mass, volume or temperature.

        Args:
            value: The number to convert, e.g. 3.5.
            from_unit: Its unit, e.g. "mi" (see list_units).
            to_unit: The unit wanted, e.g. "km".
        """
        try:
            result = convert_value(value, from_unit, to_unit)
        except UnitError as e:
            raise ToolError(str(e)) from None
        return f"{show(value)} {from_unit} = {show(result)} {to_unit}"

    @server.tool()
    def list_units() -> str:
        """The unit symbols this server knows, by quantity."""
        kinds: dict[str, list[str]] = {}
        for unit, (kind, _) in UNITS.items():
            kinds.setdefault(kind, []).append(unit)
        return "; ".join(f"{kind}: {', '.join(units)}" for kind, units in kinds.items())

    return server


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--http", type=int, default=None, metavar="PORT", help="serve streamable HTTP on this port")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")  # plain, not rich
    if args.http is None:
        build_server().run()
    else:
        build_server().run("streamable-http", host="127.0.0.1", port=args.http)
