// Command hostpath is the tests' CSI driver: volumes are directories on the node, snapshots are
// copies of them. It exists because no CSI driver with snapshot support is served by the Go module
// proxy the tests build from (csi-driver-host-path is not), while the parts around it are: the
// kubelet mounts its volumes through the real CSI node calls, and the real external-provisioner,
// external-snapshotter (csi-snapshotter) and snapshot-controller drive its controller calls. It is
// a test double for one thing only, the storage system behind the CSI calls; see README.md.
//
// One process serves the CSI Identity, Controller and Node services on --endpoint and registers
// itself with the kubelet's plugin watcher (the job node-driver-registrar does elsewhere) through
// a registration socket in --registration-dir.
package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"log"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
	registration "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

const version = "1.0.0"

type driver struct {
	csi.UnimplementedIdentityServer
	csi.UnimplementedControllerServer
	csi.UnimplementedNodeServer

	name   string
	nodeID string
	state  string // <state>/volumes/<id>/data, <state>/snapshots/<id>/data, each with meta.json

	mu sync.Mutex // one controller or node change at a time: the copies are the slow part
}

// A volume's or snapshot's record beside its data.
type meta struct {
	Name      string `json:"name"`
	Source    string `json:"source,omitempty"` // a snapshot's volume
	SizeBytes int64  `json:"sizeBytes"`
	CreatedNs int64  `json:"createdNs"`
}

func main() {
	d := &driver{}
	endpoint := flag.String("endpoint", "", "unix socket path the CSI services listen on")
	regDir := flag.String("registration-dir", "/var/lib/kubelet/plugins_registry", "the kubelet's plugin registration directory (empty: do not register)")
	flag.StringVar(&d.name, "driver-name", "hostpath.csi.podvolume.test", "the CSI driver name")
	flag.StringVar(&d.nodeID, "node-id", "", "this node's name")
	flag.StringVar(&d.state, "state-dir", "/var/lib/podvolume-csi-hostpath", "where volumes and snapshots are kept")
	flag.Parse()
	if *endpoint == "" || d.nodeID == "" {
		log.Fatal("--endpoint and --node-id are required")
	}
	for _, sub := range []string{"volumes", "snapshots"} {
		if err := os.MkdirAll(filepath.Join(d.state, sub), 0o700); err != nil {
			log.Fatal(err)
		}
	}

	srv := grpc.NewServer(grpc.UnaryInterceptor(logCalls))
	csi.RegisterIdentityServer(srv, d)
	csi.RegisterControllerServer(srv, d)
	csi.RegisterNodeServer(srv, d)
	lis := listen(*endpoint)
	go func() { log.Fatal(srv.Serve(lis)) }()

	var reg *grpc.Server
	if *regDir != "" {
		reg = grpc.NewServer()
		registration.RegisterRegistrationServer(reg, &registrar{name: d.name, endpoint: *endpoint})
		sock := filepath.Join(*regDir, d.name+"-reg.sock")
		rl := listen(sock)
		go func() { log.Fatal(reg.Serve(rl)) }()
		defer os.Remove(sock)
	}
	log.Printf("hostpath %s: driver %s on node %s at %s, state in %s", version, d.name, d.nodeID, *endpoint, d.state)

	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	<-sig
	if reg != nil {
		reg.Stop()
	}
	srv.Stop()
	os.Remove(*endpoint)
}

func listen(path string) net.Listener {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		log.Fatal(err)
	}
	_ = os.Remove(path)
	l, err := net.Listen("unix", path)
	if err != nil {
		log.Fatal(err)
	}
	return l
}

func logCalls(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	resp, err := h(ctx, req)
	if err != nil {
		log.Printf("%s: %v", info.FullMethod, err)
	} else if !strings.HasSuffix(info.FullMethod, "/Probe") && !strings.Contains(info.FullMethod, "GetCapabilities") {
		log.Printf("%s: ok", info.FullMethod)
	}
	return resp, err
}

// registrar answers the kubelet's plugin watcher.
type registrar struct {
	registration.UnimplementedRegistrationServer
	name, endpoint string
}

func (r *registrar) GetInfo(context.Context, *registration.InfoRequest) (*registration.PluginInfo, error) {
	return &registration.PluginInfo{Type: registration.CSIPlugin, Name: r.name, Endpoint: r.endpoint, SupportedVersions: []string{"1.0.0"}}, nil
}

func (r *registrar) NotifyRegistrationStatus(_ context.Context, s *registration.RegistrationStatus) (*registration.RegistrationStatusResponse, error) {
	if s.PluginRegistered {
		log.Printf("registered with the kubelet")
	} else {
		log.Printf("the kubelet refused the registration: %s", s.Error)
	}
	return &registration.RegistrationStatusResponse{}, nil
}

// Identity

func (d *driver) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: d.name, VendorVersion: version}, nil
}

func (d *driver) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	return &csi.GetPluginCapabilitiesResponse{Capabilities: []*csi.PluginCapability{{
		Type: &csi.PluginCapability_Service_{Service: &csi.PluginCapability_Service{Type: csi.PluginCapability_Service_CONTROLLER_SERVICE}},
	}}}, nil
}

func (d *driver) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	return &csi.ProbeResponse{}, nil
}

// Controller

func (d *driver) ControllerGetCapabilities(context.Context, *csi.ControllerGetCapabilitiesRequest) (*csi.ControllerGetCapabilitiesResponse, error) {
	var caps []*csi.ControllerServiceCapability
	for _, c := range []csi.ControllerServiceCapability_RPC_Type{
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME,
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT,
		csi.ControllerServiceCapability_RPC_LIST_SNAPSHOTS,
		csi.ControllerServiceCapability_RPC_CLONE_VOLUME,
	} {
		caps = append(caps, &csi.ControllerServiceCapability{Type: &csi.ControllerServiceCapability_Rpc{Rpc: &csi.ControllerServiceCapability_RPC{Type: c}}})
	}
	return &csi.ControllerGetCapabilitiesResponse{Capabilities: caps}, nil
}

// id turns a CO-given name into a directory name: stable (so a retried call finds its volume)
// and safe whatever the name holds.
func id(prefix, name string) string {
	sum := sha256.Sum256([]byte(name))
	return prefix + hex.EncodeToString(sum[:12])
}

func validID(s string) bool {
	if len(s) < 5 || len(s) > 64 {
		return false
	}
	for _, c := range s {
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-') {
			return false
		}
	}
	return true
}

func fileSystemOnly(caps []*csi.VolumeCapability) error {
	for _, c := range caps {
		if c.GetBlock() != nil {
			return status.Error(codes.InvalidArgument, "this driver serves file-system volumes only, not volumeMode: Block")
		}
	}
	return nil
}

func (d *driver) CreateVolume(_ context.Context, req *csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error) {
	if req.Name == "" {
		return nil, status.Error(codes.InvalidArgument, "name is required")
	}
	if err := fileSystemOnly(req.VolumeCapabilities); err != nil {
		return nil, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	vid := id("vol-", req.Name)
	dir := filepath.Join(d.state, "volumes", vid)
	size := req.GetCapacityRange().GetRequiredBytes()
	var source *csi.VolumeContentSource
	if m, err := readMeta(dir); err == nil {
		source = req.VolumeContentSource
		return &csi.CreateVolumeResponse{Volume: &csi.Volume{VolumeId: vid, CapacityBytes: m.SizeBytes, ContentSource: source}}, nil
	}
	tmp := dir + ".creating"
	_ = os.RemoveAll(tmp)
	defer os.RemoveAll(tmp) // gone by the rename when all went well
	if err := os.MkdirAll(tmp, 0o700); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	data := filepath.Join(tmp, "data")
	if src := req.VolumeContentSource; src != nil {
		var from string
		switch {
		case src.GetSnapshot() != nil:
			sid := src.GetSnapshot().SnapshotId
			if !validID(sid) {
				return nil, status.Errorf(codes.NotFound, "snapshot %q not found", sid)
			}
			from = filepath.Join(d.state, "snapshots", sid)
		case src.GetVolume() != nil:
			svid := src.GetVolume().VolumeId
			if !validID(svid) {
				return nil, status.Errorf(codes.NotFound, "volume %q not found", svid)
			}
			from = filepath.Join(d.state, "volumes", svid)
		}
		m, err := readMeta(from)
		if err != nil {
			return nil, status.Errorf(codes.NotFound, "content source not found: %v", err)
		}
		if m.SizeBytes > size {
			size = m.SizeBytes
		}
		if err := copyTree(filepath.Join(from, "data"), data); err != nil {
			return nil, status.Error(codes.Internal, err.Error())
		}
		source = src
	} else if err := os.Mkdir(data, 0o777); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	} else if err := os.Chmod(data, 0o777); err != nil { // a pod of any user can write, as on a fresh file system
		return nil, status.Error(codes.Internal, err.Error())
	}
	if err := writeMeta(tmp, meta{Name: req.Name, SizeBytes: size, CreatedNs: time.Now().UnixNano()}); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	if err := os.Rename(tmp, dir); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	return &csi.CreateVolumeResponse{Volume: &csi.Volume{VolumeId: vid, CapacityBytes: size, ContentSource: source}}, nil
}

func (d *driver) DeleteVolume(_ context.Context, req *csi.DeleteVolumeRequest) (*csi.DeleteVolumeResponse, error) {
	if !validID(req.VolumeId) {
		return &csi.DeleteVolumeResponse{}, nil // never made here: nothing to delete
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := os.RemoveAll(filepath.Join(d.state, "volumes", req.VolumeId)); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	return &csi.DeleteVolumeResponse{}, nil
}

func (d *driver) ValidateVolumeCapabilities(_ context.Context, req *csi.ValidateVolumeCapabilitiesRequest) (*csi.ValidateVolumeCapabilitiesResponse, error) {
	if _, err := readMeta(filepath.Join(d.state, "volumes", req.VolumeId)); !validID(req.VolumeId) || err != nil {
		return nil, status.Errorf(codes.NotFound, "volume %q not found", req.VolumeId)
	}
	if err := fileSystemOnly(req.VolumeCapabilities); err != nil {
		return &csi.ValidateVolumeCapabilitiesResponse{Message: err.Error()}, nil
	}
	return &csi.ValidateVolumeCapabilitiesResponse{Confirmed: &csi.ValidateVolumeCapabilitiesResponse_Confirmed{VolumeCapabilities: req.VolumeCapabilities}}, nil
}

func (d *driver) CreateSnapshot(_ context.Context, req *csi.CreateSnapshotRequest) (*csi.CreateSnapshotResponse, error) {
	if req.Name == "" || !validID(req.SourceVolumeId) {
		return nil, status.Error(codes.InvalidArgument, "name and a source volume of this driver are required")
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	sid := id("snap-", req.Name)
	dir := filepath.Join(d.state, "snapshots", sid)
	if m, err := readMeta(dir); err == nil {
		if m.Source != req.SourceVolumeId {
			return nil, status.Errorf(codes.AlreadyExists, "snapshot %q exists for another volume", req.Name)
		}
		return &csi.CreateSnapshotResponse{Snapshot: snapshotOf(sid, m)}, nil
	}
	from := filepath.Join(d.state, "volumes", req.SourceVolumeId)
	if _, err := readMeta(from); err != nil {
		return nil, status.Errorf(codes.NotFound, "volume %q not found", req.SourceVolumeId)
	}
	tmp := dir + ".creating"
	_ = os.RemoveAll(tmp)
	defer os.RemoveAll(tmp)
	if err := os.MkdirAll(tmp, 0o700); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	if err := copyTree(filepath.Join(from, "data"), filepath.Join(tmp, "data")); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	size, err := treeBytes(filepath.Join(tmp, "data"))
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	m := meta{Name: req.Name, Source: req.SourceVolumeId, SizeBytes: size, CreatedNs: time.Now().UnixNano()}
	if err := writeMeta(tmp, m); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	if err := os.Rename(tmp, dir); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	return &csi.CreateSnapshotResponse{Snapshot: snapshotOf(sid, m)}, nil
}

func snapshotOf(sid string, m meta) *csi.Snapshot {
	return &csi.Snapshot{SnapshotId: sid, SourceVolumeId: m.Source, SizeBytes: m.SizeBytes,
		CreationTime: timestamppb.New(time.Unix(0, m.CreatedNs)), ReadyToUse: true}
}

func (d *driver) DeleteSnapshot(_ context.Context, req *csi.DeleteSnapshotRequest) (*csi.DeleteSnapshotResponse, error) {
	if !validID(req.SnapshotId) {
		return &csi.DeleteSnapshotResponse{}, nil
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := os.RemoveAll(filepath.Join(d.state, "snapshots", req.SnapshotId)); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	return &csi.DeleteSnapshotResponse{}, nil
}

func (d *driver) ListSnapshots(_ context.Context, req *csi.ListSnapshotsRequest) (*csi.ListSnapshotsResponse, error) {
	var entries []*csi.ListSnapshotsResponse_Entry
	add := func(sid string) {
		if m, err := readMeta(filepath.Join(d.state, "snapshots", sid)); err == nil &&
			(req.SourceVolumeId == "" || req.SourceVolumeId == m.Source) {
			entries = append(entries, &csi.ListSnapshotsResponse_Entry{Snapshot: snapshotOf(sid, m)})
		}
	}
	if req.SnapshotId != "" {
		if validID(req.SnapshotId) {
			add(req.SnapshotId)
		}
		return &csi.ListSnapshotsResponse{Entries: entries}, nil
	}
	names, err := os.ReadDir(filepath.Join(d.state, "snapshots"))
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	for _, n := range names {
		if validID(n.Name()) {
			add(n.Name())
		}
	}
	return &csi.ListSnapshotsResponse{Entries: entries}, nil
}

// Node

func (d *driver) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	return &csi.NodeGetInfoResponse{NodeId: d.nodeID}, nil
}

func (d *driver) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	return &csi.NodeGetCapabilitiesResponse{}, nil
}

// NodePublishVolume bind-mounts the volume's directory at the kubelet's target path.
func (d *driver) NodePublishVolume(_ context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	if req.TargetPath == "" || req.VolumeCapability == nil {
		return nil, status.Error(codes.InvalidArgument, "target path and volume capability are required")
	}
	if err := fileSystemOnly([]*csi.VolumeCapability{req.VolumeCapability}); err != nil {
		return nil, err
	}
	src := filepath.Join(d.state, "volumes", req.VolumeId)
	if _, err := readMeta(src); !validID(req.VolumeId) || err != nil {
		return nil, status.Errorf(codes.NotFound, "volume %q not found", req.VolumeId)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if mounted(req.TargetPath) {
		return &csi.NodePublishVolumeResponse{}, nil
	}
	if err := os.MkdirAll(req.TargetPath, 0o750); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	if err := syscall.Mount(filepath.Join(src, "data"), req.TargetPath, "", syscall.MS_BIND, ""); err != nil {
		return nil, status.Errorf(codes.Internal, "bind mount: %v", err)
	}
	if req.Readonly {
		if err := syscall.Mount("", req.TargetPath, "", syscall.MS_BIND|syscall.MS_REMOUNT|syscall.MS_RDONLY, ""); err != nil {
			_ = syscall.Unmount(req.TargetPath, 0)
			return nil, status.Errorf(codes.Internal, "read-only remount: %v", err)
		}
	}
	return &csi.NodePublishVolumeResponse{}, nil
}

func (d *driver) NodeUnpublishVolume(_ context.Context, req *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for mounted(req.TargetPath) {
		if err := syscall.Unmount(req.TargetPath, 0); err != nil {
			return nil, status.Errorf(codes.Internal, "unmount: %v", err)
		}
	}
	if err := os.Remove(req.TargetPath); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, status.Error(codes.Internal, err.Error())
	}
	return &csi.NodeUnpublishVolumeResponse{}, nil
}

// mounted: is path a mount point (in /proc/self/mountinfo)?
func mounted(path string) bool {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return false
	}
	clean := filepath.Clean(path)
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && unescapeMountPath(f[4]) == clean {
			return true
		}
	}
	return false
}

func unescapeMountPath(s string) string {
	r := strings.NewReplacer(`\040`, " ", `\011`, "\t", `\012`, "\n", `\134`, `\`)
	return r.Replace(s)
}

// Helpers

func copyTree(from, to string) error {
	// cp keeps owners, modes, times, links and holes; the driver runs as root.
	out, err := exec.Command("cp", "-a", "--sparse=always", "--", from, to).CombinedOutput()
	if err != nil {
		return fmt.Errorf("copy %s: %v: %s", from, err, strings.TrimSpace(string(out)))
	}
	return nil
}

func treeBytes(dir string) (int64, error) {
	var n int64
	err := filepath.WalkDir(dir, func(_ string, e fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if e.Type().IsRegular() {
			info, err := e.Info()
			if err != nil {
				return err
			}
			n += info.Size()
		}
		return nil
	})
	return n, err
}

func readMeta(dir string) (meta, error) {
	var m meta
	b, err := os.ReadFile(filepath.Join(dir, "meta.json"))
	if err != nil {
		return m, err
	}
	return m, json.Unmarshal(b, &m)
}

func writeMeta(dir string, m meta) error {
	b, err := json.Marshal(m)
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "meta.json"), b, 0o600)
}
