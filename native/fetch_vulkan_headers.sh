#!/usr/bin/env bash
# Vulkan headers new enough for the pinned ggml-vulkan (it uses vk::LayerSettingEXT, which Debian
# 12's 1.3.239 headers lack): Debian 13's libvulkan-dev (1.4.x), downloaded with apt from the
# mirror this machine's Debian sources already name, through a private apt state (the system's
# sources and package lists stay as they are), and unpacked into native/vendor/vulkan.
# Only the headers are used; the loader, glslc and lavapipe are this Debian's own packages.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dest=$here/vendor/vulkan
[ -f "$dest/usr/include/vulkan/vulkan.hpp" ] && exit 0
state=$(mktemp -d)
trap 'rm -rf "$state"' EXIT
uri=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
[ -n "$uri" ] || uri=$(awk '/^deb / {print $2; exit}' /etc/apt/sources.list)
mkdir -p "$state/parts" "$state/lists/partial" "$state/cache/archives/partial"
printf 'Types: deb\nURIs: %s\nSuites: trixie\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
    "$uri" > "$state/parts/trixie.sources"
apt_opts=(-q -o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$state/parts"
          -o "Dir::State::Lists=$state/lists" -o "Dir::Cache=$state/cache" -o APT::Sandbox::User=root)
apt-get "${apt_opts[@]}" update >/dev/null
(cd "$state" && apt-get "${apt_opts[@]}" download libvulkan-dev >/dev/null)
rm -rf "$dest" && mkdir -p "$dest"
dpkg -x "$state"/libvulkan-dev_*.deb "$dest"
echo "fetch_vulkan_headers: $(grep -m1 '#define VK_HEADER_VERSION ' "$dest/usr/include/vulkan/vulkan_core.h") in $dest"
