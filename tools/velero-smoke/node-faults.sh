# Case 9 of scripts/velero-smoke.sh (sourced; uses its helpers and variables): the agent's pod
# replaced on the real node while it backs up, the two ways a node replaces it:
#
#   delete   `kubectl delete pod` of the agent's pod: the kubelet sends SIGTERM (grace period 60 s),
#            the DaemonSet controller makes a new pod;
#   rollout  a new image tag set on the DaemonSet (`kubectl set image`), as an upgrade does: the
#            DaemonSet controller deletes the old pod and makes one from the new image.
#
# Either way: the old pod's uploader stops with it (none left on the node), the new pod runs the
# interrupted PodVolumeBackup again (the agent leaves it InProgress on SIGTERM and runs this
# node's unfinished objects at start), and the object ends Completed with its snapshot or Failed
# saying why -- never stranded InProgress; the Backup ends accordingly; no finalizer, no restic
# lock left in the repository.

# The volume of case 4/5 (SLOW) gets a new sparse file each time, so that restic, given the last
# snapshot as parent, cannot skip it. kopia reads 16 GiB of zeros in 10-25 s here, restic 12 GiB in
# 12-25 s: long enough to be seen running and replaced, short enough to run twice.

# The uploader processes on the node that are not Velero's server's own (Velero 1.16's server
# runs restic itself, e.g. to check a repository, in its process group), each as
# "<pid> (<args>)"; empty when none.
node_uploaders() {
  local p
  for p in $(pgrep -x "$UPLOADER" || true); do
    [ "$(ps -o pgid= -p "$p" 2>/dev/null | tr -d ' ')" = "${velero_pg:-}" ] && continue
    printf '%s (%s) ' "$p" "$(ps -o args= -p "$p" 2>/dev/null | cut -c1-120)"
  done
}
no_node_uploader() { [ -z "$(node_uploaders)" ]; }

# (case 9 follows)

case9_agent_pod_replaced() {
  local how=$1 b="b-pod-$1" size old_pod old_pids new_pod phase msg t0 left d
  d=$(voldir "$SLOW" slow data)
  step_begin "case 9 ($how): the agent's pod replaced mid-backup ($([ "$how" = delete ] && echo 'kubectl delete pod' || echo 'DaemonSet rollout to a new image tag'))"
  if [ "$UPLOADER" = kopia ]; then size=16G; else size=12G; fi
  rm -f "$d"/huge*.img
  truncate -s "$size" "$d/huge-$how.img"
  backup_backing_up_slow "$b"
  old_pod=$ds_pod
  old_pids=$(uploader_pids | tr '\n' ' ')
  save_agent_log
  echo "  PodVolumeBackup $(pvb_of "$b" metadata.name) InProgress, $UPLOADER PID(s) $old_pids in pod $old_pod; replacing the pod"
  t0=$SECONDS
  if [ "$how" = delete ]; then
    k -n "$VNS" delete pod "$old_pod" --wait=false >/dev/null
  else
    local new_ref="${agent_ref%:*}:rollout"
    NODE_BIN=$node_bin "$root/scripts/start-node.sh" --tag "$W/node" "$agent_ref" "$new_ref" 2>>"$W/node.log"
    k -n "$VNS" set image daemonset/node-agent "node-agent=$new_ref" >/dev/null
  fi
  # The old pod's processes end within its grace period: the agent stops its uploader's process
  # group on SIGTERM, and the kubelet kills what is left after 60 s.
  old_gone() { local p; for p in $old_pids; do [ -e "/proc/$p" ] && return 1; done; return 0; }
  settle 90 old_gone || true
  echo "  the old pod's $UPLOADER gone after $((SECONDS - t0)) s"
  check "$how: the old pod's $UPLOADER ($old_pids) is gone" old_gone
  new_pod_ready() {
    local name
    name=$(k -n "$VNS" get pods -l name=node-agent --field-selector "spec.nodeName=$NODE" \
      -o jsonpath='{range .items[*]}{.metadata.name} {.status.conditions[?(@.type=="Ready")].status} {.metadata.deletionTimestamp}{"\n"}{end}' 2>/dev/null \
      | awk -v old="$old_pod" '$1 != old && $2 == "True" && $3 == "" {print $1}')
    [ -n "$name" ] && new_pod=$name
  }
  if ! settle 180 new_pod_ready; then
    k -n "$VNS" get pods -o wide >&2 || true
    k -n "$VNS" get daemonset node-agent -o jsonpath='{.metadata.generation} {.status}{"\n"}' >&2 || true
    k -n "$VNS" get controllerrevisions -o wide >&2 || true
    k -n "$VNS" get events --sort-by=.lastTimestamp 2>/dev/null | tail -n 15 >&2 || true
    die "no new Ready agent pod on $NODE within 180 s after the old one ($old_pod) was replaced"
  fi
  use_agent_pod "$new_pod"
  echo "  new pod $new_pod Ready after $((SECONDS - t0)) s, image $(k -n "$VNS" get pod "$new_pod" -o jsonpath='{.spec.containers[0].image}'), agent PID $agent_pid"
  [ "$how" = rollout ] && check "rollout: the new pod runs the new tag" \
    [ "$(k -n "$VNS" get pod "$new_pod" -o jsonpath='{.spec.containers[0].image}')" = "${agent_ref%:*}:rollout" ]
  pvb_terminal() { case "$(pvb_of "$b" status.phase)" in Completed | Failed | Canceled) return 0 ;; *) return 1 ;; esac; }
  settle "$TIMEOUT" pvb_terminal || true
  settle "$TIMEOUT" backup_ended "$b" || true
  phase=$(pvb_of "$b" status.phase) msg=$(pvb_of "$b" status.message)
  echo "  PodVolumeBackup: phase $phase $((SECONDS - t0)) s after the pod was replaced, starts (annotation podvolume-agent.io/attempts) $(pvb_of "$b" 'metadata.annotations.podvolume-agent\.io/attempts'),"\
    "snapshotID $(pvb_of "$b" status.snapshotID), progress $(pvb_of "$b" status.progress), message: $(cut -c1-200 <<<"$msg")"
  echo "  Backup $b: phase $(backup_phase "$b"), errors $(k -n "$VNS" get backup "$b" -o jsonpath='{.status.errors}')"
  check "$how: the PodVolumeBackup is not left InProgress: Completed, or Failed with its cause" \
    eval '[ "$phase" = Completed ] || { [ "$phase" = Failed ] && [ -n "$msg" ]; }'
  if [ "$phase" = Completed ]; then
    check "$how: the Completed PodVolumeBackup reports its snapshot" [ -n "$(pvb_of "$b" status.snapshotID)" ]
    check "$how: the Backup ends Completed with it" [ "$(backup_phase "$b")" = Completed ]
  fi
  # Each start is counted in the annotation before the uploader runs: the old pod's was 1.
  check "$how: the new pod started it again (podvolume-agent.io/attempts: 2)" \
    [ "$(pvb_of "$b" 'metadata.annotations.podvolume-agent\.io/attempts')" = 2 ]
  settle 30 no_node_uploader || true
  left=$(node_uploaders)
  check "$how: no $UPLOADER process left on the node${left:+ (left: $left)}" [ -z "$left" ]
  check "$how: the agent's finalizer is gone" eval '! pvb_of "$b" metadata.finalizers | grep -q pod-volume-finalizer'
  if [ "$UPLOADER" = restic ]; then
    local locks
    locks=$(env -i PATH="$PATH" HOME="$W/restic-check" RESTIC_PASSWORD="$repo_password" AWS_ACCESS_KEY_ID="$ak" AWS_SECRET_ACCESS_KEY="$sk" \
      "$restic" --repo "$(restic_repo_of "$SLOW")" --cacert "$W/s3/ca.pem" --no-cache --no-lock list locks 2>"$W/restic-locks.err" | wc -l) \
      || locks="? ($(tail -n 1 "$W/restic-locks.err"))"
    check "$how: no lock left in the restic repository (restic list locks: $locks)" [ "$locks" = 0 ]
  fi
  step_end
}

# Case 10: a Backup deleted mid-transfer (`kubectl delete backup`; `velero backup delete` refuses
# a backup in progress). The garbage collector deletes its PodVolumeBackup (owner reference) and
# the agent sees the Backup gone: either way the transfer stops, the object goes, no uploader,
# finalizer or restic lock is left. Then the slow volume's repository is listed: every snapshot
# in it belongs to a PodVolumeBackup of a Backup that exists (nothing orphaned by cases 4, 5, 9
# and 10; kopia's incomplete snapshots included).
case10_backup_deleted_mid_transfer() {
  local b=b-deleted size pvb d t0 left repo_json
  step_begin "case 10: a Backup deleted mid-transfer (kubectl delete backup), then no snapshot outside a Backup"
  d=$(voldir "$SLOW" slow data)
  if [ "$UPLOADER" = kopia ]; then size=16G; else size=12G; fi
  rm -f "$d"/huge*.img
  truncate -s "$size" "$d/huge-deleted.img"
  backup_backing_up_slow "$b"
  pvb=$(pvb_of "$b" metadata.name)
  pause_uploaders STOP
  t0=$SECONDS
  k -n "$VNS" delete backup "$b" --wait=false >/dev/null
  pvb_gone() { ! k -n "$VNS" get podvolumebackup "$pvb" >/dev/null 2>&1; }
  settle "$TIMEOUT" pvb_gone || true
  pause_uploaders CONT
  echo "  PodVolumeBackup $pvb gone $((SECONDS - t0)) s after its Backup was deleted"
  check "the PodVolumeBackup of the deleted Backup is gone (garbage-collected, our finalizer released)" pvb_gone
  save_agent_log
  # The agent's JSON log: "stopping the transfer" in the PVB's span, the reason Deleted (the
  # collector came first) or OwnerDone (the agent saw the Backup gone first).
  check "the agent stopped the transfer (its log: stopping the transfer, reason Deleted or OwnerDone)" \
    eval 'grep -F "\"name\":\"$pvb\"" "$W/agent.log" | grep -F "stopping the transfer" | grep -qE "\"reason\":\"(Deleted|OwnerDone)\""'
  grep -F "\"name\":\"$pvb\"" "$W/agent.log" | grep -F "stopping the transfer" | cut -c1-200 | sed 's/^/  | /' || true
  settle 30 no_node_uploader || true
  left=$(node_uploaders)
  check "no $UPLOADER process left on the node${left:+ (left: $left)}" [ -z "$left" ]
  if [ "$UPLOADER" = restic ]; then
    local locks
    locks=$(env -i PATH="$PATH" HOME="$W/restic-check" RESTIC_PASSWORD="$repo_password" AWS_ACCESS_KEY_ID="$ak" AWS_SECRET_ACCESS_KEY="$sk" \
      "$restic" --repo "$(restic_repo_of "$SLOW")" --cacert "$W/s3/ca.pem" --no-cache --no-lock list locks 2>"$W/restic-locks.err" | wc -l) \
      || locks="? ($(tail -n 1 "$W/restic-locks.err"))"
    check "no lock left in the restic repository (restic list locks: $locks)" [ "$locks" = 0 ]
  fi
  step_end
  # Every snapshot of the slow volume's repository against the PVBs of the Backups that exist.
  if [ "$UPLOADER" = kopia ]; then
    kopia_list slow "$SLOW" && repo_json=$W/kopia-slow.json
  else
    restic_list slow "$(restic_repo_of "$SLOW")" && repo_json=$W/restic-slow.json
  fi
  k -n "$VNS" get backups -o json >"$W/backups-end.json"
  k -n "$VNS" get podvolumebackups -o json >"$W/pvbs-end.json"
  [ -n "${repo_json:-}" ] && pycheck orphans "$repo_json" "$W/backups-end.json" "$W/pvbs-end.json" "$UPLOADER"
}

# Case 11: a Restore deleted mid-transfer (`kubectl delete restore`) while the agent restores the
# slow volume's 12-16 GiB into a new namespace: the agent sees the Restore being deleted (or
# gone) and stops the uploader; the PodVolumeRestore ends Canceled/Failed saying so, or is
# collected with its owner; no uploader or restic lock is left.
case11_restore_deleted_mid_transfer() {
  local r=r-deleted target="$SLOW-r" pvr t0 left phase rc=0
  step_begin "case 11: a Restore deleted mid-transfer (kubectl delete restore)"
  bounded "$W/restore-deleted.out" "${vel_cmd[@]}" restore create "$r" --from-backup b-pod-delete \
    --namespace-mappings "$SLOW:$target" || rc=$?
  check "velero restore create $r returned 0" [ "$rc" -eq 0 ]
  pvr_of() { k -n "$VNS" get podvolumerestores -l "velero.io/restore-name=$r" -o jsonpath="{.items[0].$1}" 2>/dev/null; }
  # Paused (SIGSTOP, kopia too) the moment it is seen running, so that the restore is still
  # mid-transfer when the deletion reaches the agent, however fast the machine restores.
  pvr_moving_paused() {
    [ "$(pvr_of status.phase)" = InProgress ] && [ "$(uploaders)" -ge 1 ] || return 1
    pause_uploaders STOP any
    [ -n "$paused_groups" ]
  }
  wait_until "$TIMEOUT" "the PodVolumeRestore of $r InProgress with $UPLOADER running" pvr_moving_paused
  pvr=$(pvr_of metadata.name)
  t0=$SECONDS
  k -n "$VNS" delete restore "$r" --wait=false >/dev/null
  pvr_ended() {
    k -n "$VNS" get podvolumerestore "$pvr" >/dev/null 2>&1 || return 0
    case "$(k -n "$VNS" get podvolumerestore "$pvr" -o jsonpath='{.status.phase}')" in
      Completed | Failed | Canceled) return 0 ;; *) return 1 ;;
    esac
  }
  settle "$TIMEOUT" pvr_ended || true
  pause_uploaders CONT
  if k -n "$VNS" get podvolumerestore "$pvr" >/dev/null 2>&1; then
    # Collected between the two reads: gone.
    phase=$(k -n "$VNS" get podvolumerestore "$pvr" -o jsonpath='{.status.phase}' 2>/dev/null) || phase=gone
    echo "  PodVolumeRestore $pvr: $phase $((SECONDS - t0)) s after its Restore was deleted: $(k -n "$VNS" get podvolumerestore "$pvr" -o jsonpath='{.status.message}')"
  else
    phase=gone
    echo "  PodVolumeRestore $pvr gone $((SECONDS - t0)) s after its Restore was deleted"
  fi
  check "the PodVolumeRestore of the deleted Restore is not left running: gone, Canceled or Failed" \
    eval '[ "$phase" = gone ] || [ "$phase" = Canceled ] || [ "$phase" = Failed ]'
  save_agent_log
  grep -F "\"name\":\"$pvr\"" "$W/agent.log" | grep -F "stopping the transfer" | cut -c1-200 | sed 's/^/  | /' || true
  check "the agent stopped the restore (its log: stopping the transfer, reason OwnerDone or Deleted)" \
    eval 'grep -F "\"name\":\"$pvr\"" "$W/agent.log" | grep -F "stopping the transfer" | grep -qE "\"reason\":\"(Deleted|OwnerDone)\""'
  settle 30 no_node_uploader || true
  left=$(node_uploaders)
  check "no $UPLOADER process left on the node${left:+ (left: $left)}" [ -z "$left" ]
  step_end
}
