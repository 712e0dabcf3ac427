// flotilla-k8s-node: the test lab's kubelet stand-in.
//
// A small node agent of flotilla's tests, compiled inside Debian's kubernetes v1.20 source
// tree against its vendored packages (tests/k8s/build.sh). It stands in for the kubelet of
// one or more nodes, faithfully for what a pool of pods needs and nothing more:
//
//   - registers Node objects (capacity and allocatable: cpu, memory, pods, and
//     nvidia.com/gpu when asked; condition Ready; InternalIP 127.0.0.1; the node's kubelet
//     port in status.daemonEndpoints, which is where the API server proxies exec to), as
//     pkg/kubelet/kubelet_node_status.go does;
//   - runs each pod bound to one of its nodes (spec.nodeName) whose container has a command:
//     the container's command and args run as a host process inside the pod's own network
//     namespace, with a pod IP on the lab's bridge and the container's env (value,
//     secretKeyRef, fieldRef) and a HOME of its own (the stand-in has no images: the host's
//     files are the "image");
//   - reports pod status (Running with podIP and a ready container; Succeeded/Failed with
//     the exit code when the command ends, restartPolicy Never), as pkg/kubelet/status does;
//   - on graceful deletion kills every process of the pod's network namespace (SIGTERM,
//     SIGKILL after the grace period) and then deletes the pod with grace 0, as the kubelet
//     finalises a deletion (pkg/kubelet/status/status_manager.go);
//   - serves exec at /exec/{namespace}/{pod}/{container} over TLS on the node's port with
//     the kubelet's own streaming code (pkg/kubelet/cri/streaming/remotecommand: SPDY and
//     websocket), so `kubectl exec` goes through the real API server's proxy.
//
// There is no image pulling, no cgroup limit, no PID namespace, no volume and no probe.
package main

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"flag"
	"fmt"
	"io"
	"log"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	remotecommandconsts "k8s.io/apimachinery/pkg/util/remotecommand"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	clientremote "k8s.io/client-go/tools/remotecommand"
	"k8s.io/kubernetes/pkg/kubelet/cri/streaming/remotecommand"
	utilexec "k8s.io/utils/exec"
)

type nodeSpec struct {
	name   string
	cpu    string
	memory string
	gpus   int
	gpuTag string
	port   int
}

type nodeList []nodeSpec

func (n *nodeList) String() string { return fmt.Sprint(*n) }

// Set parses name=N1,cpu=4,memory=8Gi,gpus=0,port=10250[,accelerator=a100]
func (n *nodeList) Set(value string) error {
	s := nodeSpec{cpu: "4", memory: "8Gi"}
	for _, kv := range strings.Split(value, ",") {
		parts := strings.SplitN(kv, "=", 2)
		if len(parts) != 2 {
			return fmt.Errorf("bad node field %q", kv)
		}
		switch parts[0] {
		case "name":
			s.name = parts[1]
		case "cpu":
			s.cpu = parts[1]
		case "memory":
			s.memory = parts[1]
		case "gpus":
			v, err := strconv.Atoi(parts[1])
			if err != nil {
				return err
			}
			s.gpus = v
		case "accelerator":
			s.gpuTag = parts[1]
		case "port":
			v, err := strconv.Atoi(parts[1])
			if err != nil {
				return err
			}
			s.port = v
		default:
			return fmt.Errorf("unknown node field %q", parts[0])
		}
	}
	*n = append(*n, s)
	return nil
}

type podRun struct {
	key     string
	uid     types.UID
	netns   string
	veth    string
	ip      string
	slot    int
	home    string
	env     []string
	workdir string
	proc    *exec.Cmd
	done    chan struct{}
	stopped bool
}

type agent struct {
	client     kubernetes.Interface
	nodes      map[string]nodeSpec
	bridge     string
	prefix     string
	nsPrefix   string
	vethPrefix string
	stateDir   string
	gpuLabel   string

	mu    sync.Mutex
	pods  map[string]*podRun // by namespace/name
	slots map[int]bool
}

func run(args ...string) error {
	out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

func main() {
	var nodes nodeList
	kubeconfig := flag.String("kubeconfig", "", "kubeconfig of the API server")
	bridge := flag.String("bridge", "", "the lab's bridge")
	prefix := flag.String("subnet", "", "the bridge's /24 as a.b.c (gateway a.b.c.1)")
	nsPrefix := flag.String("netns-prefix", "", "network namespace name prefix")
	vethPrefix := flag.String("veth-prefix", "", "host veth name prefix")
	stateDir := flag.String("state-dir", "", "folder for the pods' homes and logs")
	gpuLabel := flag.String("gpu-label", "skypilot.co/accelerator", "node label naming the GPU type")
	flag.Var(&nodes, "node", "a node: name=N,cpu=4,memory=8Gi,gpus=0,port=P[,accelerator=a100] (repeatable)")
	flag.Parse()

	cfg, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
	if err != nil {
		log.Fatal(err)
	}
	cfg.QPS = 100
	cfg.Burst = 200
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		log.Fatal(err)
	}
	a := &agent{
		client: client, nodes: map[string]nodeSpec{}, bridge: *bridge, prefix: *prefix,
		nsPrefix: *nsPrefix, vethPrefix: *vethPrefix, stateDir: *stateDir, gpuLabel: *gpuLabel,
		pods: map[string]*podRun{}, slots: map[int]bool{},
	}
	cert, err := selfSigned()
	if err != nil {
		log.Fatal(err)
	}
	for _, n := range nodes {
		a.nodes[n.name] = n
		if err := a.register(n); err != nil {
			log.Fatalf("register node %s: %v", n.name, err)
		}
		ln, err := tls.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", n.port), &tls.Config{Certificates: []tls.Certificate{cert}})
		if err != nil {
			log.Fatal(err)
		}
		mux := http.NewServeMux()
		mux.HandleFunc("/exec/", a.serveExec)
		go func() { log.Print(http.Serve(ln, mux)) }()
	}
	go a.heartbeat()
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		<-sigs
		a.shutdown()
		os.Exit(0)
	}()
	fmt.Println("READY")
	a.watchPods()
}

func selfSigned() (tls.Certificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, err
	}
	tmpl := x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "flotilla-k8s-node"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * 365 * time.Hour),
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
		KeyUsage:    x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, &tmpl, &tmpl, &key.PublicKey, key)
	if err != nil {
		return tls.Certificate{}, err
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, nil
}

func (a *agent) nodeStatus(n nodeSpec) v1.NodeStatus {
	res := v1.ResourceList{
		v1.ResourceCPU:    resource.MustParse(n.cpu),
		v1.ResourceMemory: resource.MustParse(n.memory),
		v1.ResourcePods:   resource.MustParse("110"),
	}
	if n.gpus > 0 {
		res["nvidia.com/gpu"] = *resource.NewQuantity(int64(n.gpus), resource.DecimalSI)
	}
	now := metav1.Now()
	return v1.NodeStatus{
		Capacity: res, Allocatable: res,
		Conditions: []v1.NodeCondition{{
			Type: v1.NodeReady, Status: v1.ConditionTrue, Reason: "KubeletReady",
			Message: "flotilla-k8s-node is posting ready status", LastHeartbeatTime: now, LastTransitionTime: now,
		}},
		Addresses: []v1.NodeAddress{
			{Type: v1.NodeInternalIP, Address: "127.0.0.1"},
			{Type: v1.NodeHostName, Address: n.name},
		},
		DaemonEndpoints: v1.NodeDaemonEndpoints{KubeletEndpoint: v1.DaemonEndpoint{Port: int32(n.port)}},
		NodeInfo:        v1.NodeSystemInfo{KubeletVersion: "v1.20.2-flotilla-stand-in", OperatingSystem: "linux", Architecture: "amd64"},
	}
}

func (a *agent) register(n nodeSpec) error {
	ctx := context.Background()
	labels := map[string]string{"kubernetes.io/hostname": n.name, "kubernetes.io/os": "linux", "flotilla-lab": "1"}
	if n.gpuTag != "" {
		labels[a.gpuLabel] = n.gpuTag
	}
	node := &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: n.name, Labels: labels}}
	created, err := a.client.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		created, err = a.client.CoreV1().Nodes().Get(ctx, n.name, metav1.GetOptions{})
	}
	if err != nil {
		return err
	}
	created.Status = a.nodeStatus(n)
	updated, err := a.client.CoreV1().Nodes().UpdateStatus(ctx, created, metav1.UpdateOptions{})
	if err != nil {
		return err
	}
	// The API server's TaintNodesByCondition admission taints a new node not-ready; the
	// node lifecycle controller (kube-controller-manager, not run in the lab) lifts it once
	// the node reports Ready: done here, as pkg/controller/nodelifecycle does.
	var taints []v1.Taint
	for _, t := range updated.Spec.Taints {
		if t.Key != "node.kubernetes.io/not-ready" && t.Key != "node.kubernetes.io/unreachable" {
			taints = append(taints, t)
		}
	}
	updated.Spec.Taints = taints
	_, err = a.client.CoreV1().Nodes().Update(ctx, updated, metav1.UpdateOptions{})
	return err
}

func (a *agent) heartbeat() {
	for range time.Tick(20 * time.Second) {
		for _, n := range a.nodes {
			ctx := context.Background()
			node, err := a.client.CoreV1().Nodes().Get(ctx, n.name, metav1.GetOptions{})
			if err != nil {
				continue
			}
			node.Status = a.nodeStatus(n)
			_, _ = a.client.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{})
		}
	}
}

func (a *agent) watchPods() {
	for {
		ctx := context.Background()
		list, err := a.client.CoreV1().Pods("").List(ctx, metav1.ListOptions{})
		if err != nil {
			log.Printf("list pods: %v", err)
			time.Sleep(time.Second)
			continue
		}
		seen := map[string]bool{}
		for i := range list.Items {
			seen[key(&list.Items[i])] = true
			a.handle(&list.Items[i], false)
		}
		a.mu.Lock()
		for k := range a.pods {
			if !seen[k] {
				go a.stop(k, 0, nil)
			}
		}
		a.mu.Unlock()
		w, err := a.client.CoreV1().Pods("").Watch(ctx, metav1.ListOptions{
			ResourceVersion: list.ResourceVersion, FieldSelector: fields.Everything().String(),
		})
		if err != nil {
			log.Printf("watch pods: %v", err)
			continue
		}
		for ev := range w.ResultChan() {
			pod, ok := ev.Object.(*v1.Pod)
			if !ok {
				continue
			}
			a.handle(pod, ev.Type == watch.Deleted)
		}
	}
}

func key(p *v1.Pod) string { return p.Namespace + "/" + p.Name }

func (a *agent) handle(pod *v1.Pod, deleted bool) {
	if _, mine := a.nodes[pod.Spec.NodeName]; !mine {
		return
	}
	k := key(pod)
	a.mu.Lock()
	r := a.pods[k]
	if r != nil && r.uid != pod.UID {
		a.mu.Unlock()
		a.stop(k, 0, nil)
		a.mu.Lock()
		r = nil
	}
	a.mu.Unlock()
	switch {
	case deleted:
		if r != nil {
			go a.stop(k, 0, nil)
		}
	case pod.DeletionTimestamp != nil:
		grace := int64(30)
		if pod.DeletionGracePeriodSeconds != nil {
			grace = *pod.DeletionGracePeriodSeconds
		}
		p := pod.DeepCopy()
		go a.stop(k, grace, p)
	case r == nil && pod.Status.Phase == v1.PodPending:
		a.start(pod.DeepCopy())
	}
}

func (a *agent) freeSlot() int {
	for i := 2; i < 255; i++ {
		if !a.slots[i] {
			a.slots[i] = true
			return i
		}
	}
	return -1
}

func (a *agent) start(pod *v1.Pod) {
	k := key(pod)
	a.mu.Lock()
	slot := a.freeSlot()
	r := &podRun{key: k, uid: pod.UID, slot: slot, done: make(chan struct{})}
	a.pods[k] = r
	a.mu.Unlock()
	fail := func(reason string, err error) {
		log.Printf("pod %s: %s: %v", k, reason, err)
		a.teardown(r)
		a.setStatus(pod, v1.PodFailed, "", &v1.ContainerStateTerminated{ExitCode: 128, Reason: reason, Message: err.Error()})
		close(r.done)
	}
	if slot < 0 {
		fail("NoAddress", fmt.Errorf("no free pod address"))
		return
	}
	if len(pod.Spec.Containers) == 0 || len(pod.Spec.Containers[0].Command) == 0 {
		fail("NoCommand", fmt.Errorf("the lab's node runs a container's command; this one has none"))
		return
	}
	c := pod.Spec.Containers[0]
	r.netns = fmt.Sprintf("%s%d", a.nsPrefix, slot)
	r.veth = fmt.Sprintf("%s%d", a.vethPrefix, slot)
	r.ip = fmt.Sprintf("%s.%d", a.prefix, slot)
	if err := a.network(r); err != nil {
		fail("NetworkSetup", err)
		return
	}
	r.home = filepath.Join(a.stateDir, "pods", pod.Namespace+"_"+pod.Name+"_"+string(pod.UID))
	if err := os.MkdirAll(r.home, 0o755); err != nil {
		fail("Home", err)
		return
	}
	env, err := a.environment(pod, &c, r)
	if err != nil {
		fail("CreateContainerConfigError", err)
		return
	}
	r.env = env
	r.workdir = c.WorkingDir
	if r.workdir == "" {
		r.workdir = r.home
	}
	logf, err := os.Create(filepath.Join(r.home, "container.log"))
	if err != nil {
		fail("Log", err)
		return
	}
	argv := append(append([]string{"--net=/run/netns/" + r.netns, "--"}, c.Command...), c.Args...)
	cmd := exec.Command("nsenter", argv...)
	cmd.Env = env
	cmd.Dir = r.workdir
	cmd.Stdout = logf
	cmd.Stderr = logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		logf.Close()
		fail("StartError", err)
		return
	}
	r.proc = cmd
	started := metav1.Now()
	a.setStatus(pod, v1.PodRunning, r.ip, nil, started)
	go func() {
		err := cmd.Wait()
		logf.Close()
		code := 0
		if err != nil {
			code = 1
			if ee, ok := err.(*exec.ExitError); ok {
				code = ee.ExitCode()
				if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
					code = 128 + int(ws.Signal())
				}
			}
		}
		a.mu.Lock()
		stopped := r.stopped
		a.mu.Unlock()
		a.killAll(r, 0)
		a.teardown(r)
		if !stopped {
			phase := v1.PodSucceeded
			reason := "Completed"
			if code != 0 {
				phase, reason = v1.PodFailed, "Error"
			}
			a.setStatus(pod, phase, r.ip, &v1.ContainerStateTerminated{ExitCode: int32(code), Reason: reason, StartedAt: started, FinishedAt: metav1.Now()}, started)
		}
		close(r.done)
	}()
}

func (a *agent) network(r *podRun) error {
	_ = run("ip", "netns", "del", r.netns)
	_ = run("ip", "link", "del", r.veth)
	steps := [][]string{
		{"ip", "netns", "add", r.netns},
		{"ip", "link", "add", r.veth, "type", "veth", "peer", "name", "eth0", "netns", r.netns},
		{"ip", "link", "set", r.veth, "master", a.bridge, "up"},
		{"ip", "-n", r.netns, "addr", "add", r.ip + "/24", "dev", "eth0"},
		{"ip", "-n", r.netns, "link", "set", "eth0", "up"},
		{"ip", "-n", r.netns, "link", "set", "lo", "up"},
		{"ip", "-n", r.netns, "route", "add", "default", "via", a.prefix + ".1"},
	}
	for _, s := range steps {
		if err := run(s...); err != nil {
			return err
		}
	}
	return nil
}

func (a *agent) teardown(r *podRun) {
	if r.netns != "" {
		_ = run("ip", "netns", "del", r.netns)
		_ = run("ip", "link", "del", r.veth)
	}
	a.mu.Lock()
	delete(a.slots, r.slot)
	if a.pods[r.key] == r {
		delete(a.pods, r.key)
	}
	a.mu.Unlock()
}

func (a *agent) environment(pod *v1.Pod, c *v1.Container, r *podRun) ([]string, error) {
	env := []string{
		"PATH=" + os.Getenv("PATH"), "HOME=" + r.home, "HOSTNAME=" + pod.Name,
		"KUBERNETES_SERVICE_HOST=127.0.0.1",
	}
	ctx := context.Background()
	for _, from := range c.EnvFrom {
		if from.SecretRef != nil {
			s, err := a.client.CoreV1().Secrets(pod.Namespace).Get(ctx, from.SecretRef.Name, metav1.GetOptions{})
			if err != nil {
				return nil, err
			}
			for k, v := range s.Data {
				env = append(env, from.Prefix+k+"="+string(v))
			}
		}
	}
	for _, e := range c.Env {
		value := e.Value
		if e.ValueFrom != nil {
			switch {
			case e.ValueFrom.SecretKeyRef != nil:
				ref := e.ValueFrom.SecretKeyRef
				s, err := a.client.CoreV1().Secrets(pod.Namespace).Get(ctx, ref.Name, metav1.GetOptions{})
				if err != nil {
					return nil, err
				}
				value = string(s.Data[ref.Key])
			case e.ValueFrom.FieldRef != nil:
				switch e.ValueFrom.FieldRef.FieldPath {
				case "metadata.name":
					value = pod.Name
				case "metadata.namespace":
					value = pod.Namespace
				case "status.podIP":
					value = r.ip
				case "spec.nodeName":
					value = pod.Spec.NodeName
				}
			}
		}
		env = append(env, e.Name+"="+value)
	}
	return env, nil
}

func (a *agent) setStatus(pod *v1.Pod, phase v1.PodPhase, ip string, term *v1.ContainerStateTerminated, started ...metav1.Time) {
	ctx := context.Background()
	for attempt := 0; attempt < 10; attempt++ {
		cur, err := a.client.CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
		if err != nil || cur.UID != pod.UID {
			return
		}
		now := metav1.Now()
		st := &cur.Status
		st.Phase = phase
		st.HostIP = "127.0.0.1"
		if ip != "" {
			st.PodIP = ip
			st.PodIPs = []v1.PodIP{{IP: ip}}
		}
		if len(started) > 0 {
			st.StartTime = &started[0]
		}
		ready := v1.ConditionFalse
		cs := v1.ContainerStatus{Name: pod.Spec.Containers[0].Name, Image: pod.Spec.Containers[0].Image, ImageID: "flotilla-lab://host", ContainerID: "flotilla-lab://" + string(pod.UID)}
		if term != nil {
			cs.State = v1.ContainerState{Terminated: term}
		} else {
			ready = v1.ConditionTrue
			cs.Ready = true
			t := true
			cs.Started = &t
			cs.State = v1.ContainerState{Running: &v1.ContainerStateRunning{StartedAt: started[0]}}
		}
		st.ContainerStatuses = []v1.ContainerStatus{cs}
		st.Conditions = []v1.PodCondition{
			{Type: v1.PodInitialized, Status: v1.ConditionTrue, LastTransitionTime: now},
			{Type: v1.PodReady, Status: ready, LastTransitionTime: now},
			{Type: v1.ContainersReady, Status: ready, LastTransitionTime: now},
			{Type: v1.PodScheduled, Status: v1.ConditionTrue, LastTransitionTime: now},
		}
		_, err = a.client.CoreV1().Pods(pod.Namespace).UpdateStatus(ctx, cur, metav1.UpdateOptions{})
		if err == nil || !apierrors.IsConflict(err) {
			if err != nil {
				log.Printf("pod %s: status: %v", key(pod), err)
			}
			return
		}
	}
}

// pidsIn lists the processes whose network namespace is the pod's: the pod's "container".
func pidsIn(netns string) []int {
	var ns syscall.Stat_t
	if err := syscall.Stat("/run/netns/"+netns, &ns); err != nil {
		return nil
	}
	entries, _ := os.ReadDir("/proc")
	var out []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		var st syscall.Stat_t
		if syscall.Stat(fmt.Sprintf("/proc/%d/ns/net", pid), &st) != nil {
			continue
		}
		if st.Dev == ns.Dev && st.Ino == ns.Ino {
			out = append(out, pid)
		}
	}
	return out
}

// killAll stops every process of the pod: SIGTERM, then SIGKILL after grace seconds.
func (a *agent) killAll(r *podRun, grace int64) {
	if r.netns == "" {
		return
	}
	pids := pidsIn(r.netns)
	if len(pids) == 0 {
		return
	}
	if grace > 0 {
		for _, p := range pids {
			_ = syscall.Kill(p, syscall.SIGTERM)
		}
		deadline := time.Now().Add(time.Duration(grace) * time.Second)
		for time.Now().Before(deadline) && len(pidsIn(r.netns)) > 0 {
			time.Sleep(50 * time.Millisecond)
		}
	}
	for i := 0; i < 50; i++ {
		pids = pidsIn(r.netns)
		if len(pids) == 0 {
			return
		}
		for _, p := range pids {
			_ = syscall.Kill(p, syscall.SIGKILL)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// stop ends a pod's processes; with pod set (a graceful deletion), then deletes it with
// grace 0 as the kubelet does once the containers are gone.
func (a *agent) stop(k string, grace int64, pod *v1.Pod) {
	a.mu.Lock()
	r := a.pods[k]
	if r != nil && pod != nil && r.uid != pod.UID {
		r = nil
	}
	if r != nil {
		r.stopped = true
	}
	a.mu.Unlock()
	if r != nil {
		a.killAll(r, grace)
		if r.proc != nil {
			<-r.done
		} else {
			a.teardown(r)
		}
	}
	if pod != nil {
		zero := int64(0)
		uid := pod.UID
		err := a.client.CoreV1().Pods(pod.Namespace).Delete(context.Background(), pod.Name, metav1.DeleteOptions{
			GracePeriodSeconds: &zero, Preconditions: &metav1.Preconditions{UID: &uid},
		})
		if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
			log.Printf("pod %s: delete: %v", k, err)
		}
	}
}

func (a *agent) shutdown() {
	a.mu.Lock()
	runs := []*podRun{}
	for _, r := range a.pods {
		r.stopped = true
		runs = append(runs, r)
	}
	a.mu.Unlock()
	for _, r := range runs {
		a.killAll(r, 0)
		if r.proc == nil {
			a.teardown(r)
		}
	}
	for _, r := range runs {
		if r.proc != nil {
			select {
			case <-r.done:
			case <-time.After(5 * time.Second):
			}
		}
	}
}

// serveExec serves /exec/{namespace}/{pod}/{container}?command=...&input=1&output=1...
// with the kubelet's streaming code, as pkg/kubelet/server/server.go's getExec does.
func (a *agent) serveExec(w http.ResponseWriter, req *http.Request) {
	parts := strings.Split(strings.TrimPrefix(req.URL.Path, "/exec/"), "/")
	if len(parts) < 3 {
		http.Error(w, "expected /exec/{namespace}/{pod}/{container}", http.StatusBadRequest)
		return
	}
	k := parts[0] + "/" + parts[1]
	a.mu.Lock()
	r := a.pods[k]
	a.mu.Unlock()
	if r == nil || r.proc == nil {
		http.Error(w, fmt.Sprintf("pod %s is not running on this node", k), http.StatusNotFound)
		return
	}
	opts, err := remotecommand.NewOptions(req)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	cmd := req.URL.Query()["command"]
	remotecommand.ServeExec(w, req, &executor{a: a, r: r}, k, r.uid, parts[2], cmd, opts,
		4*time.Hour, 30*time.Second, remotecommandconsts.SupportedStreamingProtocols)
}

type executor struct {
	a *agent
	r *podRun
}

func (e *executor) ExecInContainer(name string, uid types.UID, container string, cmd []string, in io.Reader, out, errw io.WriteCloser, tty bool, resize <-chan clientremote.TerminalSize, timeout time.Duration) error {
	if len(cmd) == 0 {
		return fmt.Errorf("no command")
	}
	argv := append([]string{"--net=/run/netns/" + e.r.netns, "--"}, cmd...)
	c := exec.Command("nsenter", argv...)
	c.Env = e.r.env
	c.Dir = e.r.workdir
	var stdinW *os.File
	if in != nil {
		pr, pw, err := os.Pipe()
		if err != nil {
			return err
		}
		c.Stdin = pr
		stdinW = pw
		defer pr.Close()
	}
	if out != nil {
		c.Stdout = out
	}
	if errw != nil {
		c.Stderr = errw
	} else if tty && out != nil {
		c.Stderr = out
	}
	if err := c.Start(); err != nil {
		if stdinW != nil {
			stdinW.Close()
		}
		return err
	}
	if stdinW != nil {
		go func() {
			_, _ = io.Copy(stdinW, in)
			stdinW.Close()
		}()
	}
	err := c.Wait()
	if stdinW != nil {
		stdinW.Close()
	}
	if err != nil {
		if ee, ok := err.(*exec.ExitError); ok {
			return utilexec.CodeExitError{Err: err, Code: ee.ExitCode()}
		}
		return err
	}
	return nil
}
