#!/usr/bin/env bash
# Print "URI SUITE": the Debian archive this machine's apt already uses, for debootstrap
# (.ci/docker-image.sh). The repository never names a mirror; it is read from the machine:
# SUITE is VERSION_CODENAME of /etc/os-release, URI the first enabled `deb` source carrying that
# suite, from /etc/apt/sources.list, /etc/apt/sources.list.d/*.list (one-line format) and
# /etc/apt/sources.list.d/*.sources (deb822). Without a codename: the first source whose suite is
# a bare name (not -security, -updates, a flat "./").
#
# Usage: .ci/apt-mirror.sh [ROOT]   (ROOT: where etc/ lives, default /; tests pass a fake one)
# Exit 1 with one line on stderr when no such source exists.
set -euo pipefail

root="${1:-/}"
codename="$(. "$root/etc/os-release" 2>/dev/null && echo "${VERSION_CODENAME:-}" || true)"

files=()
[ -f "$root/etc/apt/sources.list" ] && files+=("$root/etc/apt/sources.list")
for f in "$root"/etc/apt/sources.list.d/*.list "$root"/etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] && files+=("$f")
done

# One "URI SUITE" line per (deb source, suite), in apt's reading order.
entries() {
    for f in "${files[@]}"; do
        case "$f" in
        *.sources) awk '
            function flush() {
                if (types ~ /(^| )deb( |$)/ && tolower(enabled) != "no" && uris != "")
                    for (i = 1; i <= split(suites, s, " "); i++) print uris, s[i]
                types = uris = suites = enabled = ""
            }
            /^#/ { next }
            /^[ \t]*$/ { flush(); next }
            {
                key = tolower($1); sub(/^[^:]*:[ \t]*/, "")
                if (key == "types:") types = $0
                else if (key == "uris:") { split($0, u, " "); uris = u[1] }
                else if (key == "suites:") suites = $0
                else if (key == "enabled:") enabled = $0
            }
            END { flush() }' "$f" ;;
        *) sed -e 's/#.*//' -e 's/\[[^]]*\]//' "$f" | awk '$1 == "deb" && NF >= 3 { print $2, $3 }' ;;
        esac
    done
}

all="$(entries)"
if [ -n "$codename" ]; then
    found="$(awk -v c="$codename" '$2 == c { print; exit }' <<<"$all")"
else
    found="$(awk '$2 ~ /^[a-z]+$/ { print; exit }' <<<"$all")"
fi
if [ -z "$found" ]; then
    echo "error: no enabled deb source for suite '${codename:-any}' in $root/etc/apt (set MIRROR and SUITE)" >&2
    exit 1
fi
awk '{ sub(/\/+$/, "", $1); print $1, $2 }' <<<"$found"
